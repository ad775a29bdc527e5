"""Checks every command runs on its options before any other work (no torch, no server).

A mistake should cost a second, not the minutes of work that come before the step that
trips on it; and the message names the flag and what it accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvpilot.errors import ConfigError, KvpilotError

T = TypeVar("T")

BUILT_IN_MODELS = ("tiny",)
CHECKPOINT_HELP = (
    "give 'tiny' (the built-in model) or a Hugging Face checkpoint folder "
    "(config.json, *.safetensors, tokenizer)"
)


def for_flag(flag: str, check: Callable[[], T]) -> T:
    """Run ``check``; a kvpilot error it raises comes back naming ``flag``."""
    try:
        return check()
    except KvpilotError as exc:
        message = str(exc)
        if message.startswith(flag):
            raise
        raise ConfigError(f"{flag}: {message}") from exc


def check_checkpoint(model: str, flag: str = "--model") -> None:
    """``model`` is a built-in model or a checkpoint folder kvpilot can load.

    Reads only config.json (architecture, geometry) and looks for the weight files, so it
    takes milliseconds where loading would take seconds to minutes.
    """
    if model in BUILT_IN_MODELS:
        return
    from kvpilot.errors import ModelLoadError
    from kvpilot.model.config import ModelConfig

    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"{flag} {model!r} is not a built-in model nor a folder: {CHECKPOINT_HELP}"
        )
    try:
        ModelConfig.from_folder(path)
    except ModelLoadError as exc:
        raise ConfigError(f"{flag} {model!r}: {exc}") from exc
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any((path / name).is_file() for name in weights):
        raise ConfigError(
            f"{flag} {model!r}: no model.safetensors or model.safetensors.index.json in the "
            "folder (kvpilot reads safetensors weights only)"
        )


def check_choice(value: str, choices: tuple[str, ...], flag: str) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(choices)}")


# What `kvpilot.model.runner` accepts (checked here without importing torch; a test keeps
# the two in step).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: str | None, flag: str = "--device") -> None:
    if device is not None and not _DEVICE.match(device):
        raise ConfigError(f"{flag} {device!r} is not one of: cpu, cuda, cuda:N")
