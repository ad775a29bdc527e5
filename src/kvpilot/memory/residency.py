"""Where a trajectory's cached prefix is, as admission sees it."""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    """Answer to "is this trajectory's cached prefix on the device?"."""

    READY = "ready"  # everything cached is device-resident (or nothing is cached elsewhere)
    LOADING = "loading"  # a load from host or disk is in flight: wait for it
    NO_ROOM = "no_room"  # it must be loaded, and the device has no free blocks to load into
