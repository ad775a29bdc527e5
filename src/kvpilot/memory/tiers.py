"""Memory tiers a KV block can live in."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
