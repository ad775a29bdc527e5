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


class SessionNotFound(InvalidRequest):
    """No open session has this id (it was never opened, or it was closed)."""


class SessionBusy(InvalidRequest):
    """The session is running a turn; the operation waits for it to finish (or fork it)."""


class SessionQuotaExceeded(InvalidRequest):
    """Opening another session would exceed its owner's limit of open sessions."""


class ModelLoadError(KvpilotError):
    """A model folder is missing, unreadable, or its config is malformed."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint's architecture is not one kvpilot implements."""


def require(condition: bool, message: str) -> None:
    """An integrity check of a ``check_invariants()``: AssertionError with ``message`` unless
    ``condition`` holds (kept under ``python -O``, unlike ``assert``)."""
    if not condition:
        raise AssertionError(message)


class NoReplicaAvailable(KvpilotError):
    """Every replica of a fleet is down (or none has started yet)."""


class TensorParallelError(KvpilotError):
    """A tensor-parallel worker died, failed or stopped answering; the engine cannot go on."""
