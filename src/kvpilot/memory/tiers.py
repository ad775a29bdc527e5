"""Memory tiers a KV block can live in."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


# The members as module constants, for hot paths: reading an enum member through its class
# (``Tier.DEVICE``) is an attribute lookup each time.
DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
