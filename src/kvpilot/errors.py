"""Typed errors. Each carries a message a user can act on."""

from __future__ import annotations


class KvpilotError(Exception):
    """Base class of every error kvpilot raises on purpose."""


class ConfigError(KvpilotError, ValueError):
    """A configuration value (CLI flag, preset name, config.json field) is invalid."""


class OutOfBlocks(KvpilotError):
    """A block pool cannot satisfy an allocation; the scheduler handles it (evict, preempt)."""

    def __init__(self, tier: str, requested: int, free: int) -> None:
        super().__init__(f"{tier} pool: requested {requested} blocks, only {free} free")
        self.tier = tier
        self.requested = requested
        self.free = free


class InvalidRequest(KvpilotError, ValueError):
    """A request is malformed (bad token ids, bad sampling parameters, ...)."""


class PromptTooLong(InvalidRequest):
    """The prompt (plus requested output) does not fit the model's context."""


class ModelLoadError(KvpilotError):
    """A model folder is missing, unreadable, or its config is malformed."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint's architecture is not one kvpilot implements."""


class NoReplicaAvailable(KvpilotError):
    """Every replica of a fleet is down (or none has started yet)."""
