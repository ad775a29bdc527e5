"""Finding a checkpoint folder and reading its safetensors weights (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from kvpilot.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def resolve_model_path(name_or_path: str | Path, cache_dir: Path | None = None) -> Path:
    """``"tiny"`` -> the built-in model (generated on first use); otherwise an existing folder."""
    if str(name_or_path) == "tiny":
        from kvpilot.model.tiny import ensure_tiny_model

        return ensure_tiny_model(cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {str(name_or_path)!r} is neither 'tiny' nor an existing folder; pass the "
            "path of a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)"
        )
    return path.resolve()


def weight_files(folder: Path) -> list[Path]:
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    index = folder / SHARD_INDEX
    if not index.is_file():
        raise ModelLoadError(
            f"no weights in {folder}: expected {SINGLE_FILE} or {SHARD_INDEX} (kvpilot reads "
            "safetensors only; convert .bin checkpoints with save_pretrained)"
        )
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is malformed (needs a 'weight_map' object): {exc}") from exc
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise ModelLoadError(f"{index} names missing shard files: {', '.join(missing)}")
    return [folder / s for s in shards]


class LoadProgress(Protocol):
    """Told how loading a checkpoint goes (e.g. `kvpilot serve`'s start-up banner)."""

    def step(self, what: str) -> None:
        """A loading step starts: "tokenizer", "weights", "kv_pool"."""
        ...

    def weights(self, done_bytes: int, total_bytes: int) -> None:
        """Weight bytes read so far, of the checkpoint's weight files' total."""
        ...


def iter_weights(
    folder: Path, progress: LoadProgress | None = None, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file, read straight onto ``device``."""
    from safetensors import SafetensorError, safe_open

    target = str(torch.device(device))
    files = weight_files(folder)
    total = sum(path.stat().st_size for path in files)
    done = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=target) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    tensor = handle.get_tensor(name)
                    if progress is not None:
                        done += tensor.nbytes
                        progress.weights(min(done, total), total)
                    yield name, tensor
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read weights from {path}: {exc}") from exc
    if progress is not None:
        progress.weights(total, total)
