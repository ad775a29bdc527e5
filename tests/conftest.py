"""Shared fixtures: tiny Hugging Face checkpoints per architecture, and the built-in tiny model.

Everything is generated locally (no downloads) once per test session, only when first used.
"""

from __future__ import annotations

import os

# One intra-op thread: on a 2-core machine torch's default of 2 stalls whenever anything
# else runs (a server thread, a subprocess), and tests care about results, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest


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
