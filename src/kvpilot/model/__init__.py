"""PyTorch model runner: Llama-family checkpoints on a paged KV pool.

Names are imported lazily so that torch-free code (the simulator reading a `ModelConfig`)
can import ``kvpilot.model.config`` without pulling in torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.model.checkpoints import make_checkpoint as make_checkpoint
    from kvpilot.model.config import ModelConfig as ModelConfig
    from kvpilot.model.loader import resolve_model_path as resolve_model_path
    from kvpilot.model.runner import ModelRunner as ModelRunner
    from kvpilot.model.sampler import Sampler as Sampler

_EXPORTS = {
    "ModelConfig": "kvpilot.model.config",
    "ModelRunner": "kvpilot.model.runner",
    "Sampler": "kvpilot.model.sampler",
    "make_checkpoint": "kvpilot.model.checkpoints",
    "resolve_model_path": "kvpilot.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.model' has no attribute {name!r}")
    return getattr(import_module(module), name)
