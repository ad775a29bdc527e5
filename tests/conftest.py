"""Shared fixtures: tiny Hugging Face checkpoints per architecture, and the built-in tiny model.

Everything is generated locally (no downloads) once per test session, only when first used.
Every engine the suite builds poisons freed KV blocks (`RunnerConfig.poison_freed_blocks`
defaults to on for the whole session), so a stale or missed block shows as NaN or wrong
output instead of passing silently.
"""

from __future__ import annotations

import os

# One intra-op thread: on a 2-core machine torch's default of 2 stalls whenever anything
# else runs (a server thread, a subprocess), and tests care about results, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


@contextmanager
def config_default(cls: type, name: str, value: Any) -> Iterator[None]:
    """Within the block, ``cls(...)`` (a dataclass) defaults its field ``name`` to ``value``."""
    init = cls.__init__  # type: ignore[misc]
    params = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]
    saved = init.__defaults__
    assert saved is not None and name in params[len(params) - len(saved) :], name
    defaults = list(saved)
    defaults[params.index(name) - (len(params) - len(saved))] = value
    init.__defaults__ = tuple(defaults)
    try:
        yield
    finally:
        init.__defaults__ = saved


@pytest.fixture(scope="session", autouse=True)
def poison_freed_kv_blocks() -> Iterator[None]:
    """Every engine of the suite overwrites freed KV blocks with NaN (a config default, so a
    test that wants it off says ``poison_freed_blocks=False``)."""
    from kvpilot.engine.config import RunnerConfig

    with config_default(RunnerConfig, "poison_freed_blocks", True):
        yield


class _LazyCheckpoints(Mapping[str, Path]):
    """arch -> checkpoint folder, written by `make_checkpoint` on first access."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __getitem__(self, arch: str) -> Path:
        from kvpilot.model.checkpoints import ARCHITECTURES, make_checkpoint

        if arch not in ARCHITECTURES:
            raise KeyError(arch)
        if arch not in self.built:
            self.built[arch] = make_checkpoint(arch, self.root / arch)
        return self.built[arch]

    def __iter__(self) -> Iterator[str]:
        from kvpilot.model.checkpoints import ARCHITECTURES

        return iter(ARCHITECTURES)

    def __len__(self) -> int:
        from kvpilot.model.checkpoints import ARCHITECTURES

        return len(ARCHITECTURES)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, Path]:
    """Tiny checkpoints of "llama" (llama3 rope), "qwen2", "qwen3", "mistral" (sliding window 8)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    return _LazyCheckpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def hf_checkpoint(checkpoints: Mapping[str, Path]) -> Callable[[str], Path]:
    """``hf_checkpoint("qwen3")`` -> path of that tiny checkpoint."""
    return checkpoints.__getitem__


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in ``tiny`` model, generated into a session temp cache (not ~/.cache)."""
    from kvpilot.model.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("model-cache"))
