"""The engine: scheduler, step loop, clock, sampling parameters, sessions."""

from kvpilot.engine.clock import Clock, VirtualClock, WallClock
from kvpilot.engine.config import (
    EngineConfig,
    PauseConfig,
    RunnerConfig,
    SchedulerConfig,
    TierConfig,
)
from kvpilot.engine.engine import Engine
from kvpilot.engine.executor import Executor, SeqWork, StepOutput
from kvpilot.engine.request import CompletionOutput, PromptIds, RequestOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.session import Session
from kvpilot.engine.stats import EngineStats

__all__ = [
    "Clock",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "PauseConfig",
    "PromptIds",
    "RequestOutput",
    "RunnerConfig",
    "SamplingParams",
    "SchedulerConfig",
    "SeqWork",
    "Session",
    "StepOutput",
    "TierConfig",
    "VirtualClock",
    "WallClock",
]
