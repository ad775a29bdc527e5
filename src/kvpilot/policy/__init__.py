"""Policies over the memory core: what to do with a paused trajectory's KV state, and more."""

from __future__ import annotations

from kvpilot.policy.breakeven import (
    DEFAULT_THRESHOLDS,
    PauseAction,
    PauseDecision,
    PauseInputs,
    PauseThresholds,
    decide_pause,
)

__all__ = [
    "DEFAULT_THRESHOLDS",
    "PauseAction",
    "PauseDecision",
    "PauseInputs",
    "PauseThresholds",
    "decide_pause",
]
