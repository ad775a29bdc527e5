"""Reading one rank's slices of a checkpoint straight from its safetensors files.

Each rank opens the files itself and reads only the byte ranges of its slices
(``safe_open(...).get_slice``), so a node never materialises the whole model per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from kvpilot.errors import ModelLoadError
from kvpilot.model.loader import weight_files
from kvpilot.model.parallel.plan import ShardPlan


def iter_shard_weights(
    folder: Path, plan: ShardPlan, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) for every tensor of the checkpoint, on ``device``."""
    from safetensors import SafetensorError, safe_open

    target = str(torch.device(device))
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=target) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield name, _read(handle, name, plan)
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read weights from {path}: {exc}") from exc


def _read(handle: object, name: str, plan: ShardPlan) -> torch.Tensor:
    part = handle.get_slice(name)  # type: ignore[attr-defined]
    shape = tuple(part.get_shape())
    cut = plan.slice_for(name)
    if cut is None:
        tensor: torch.Tensor = part[:]
    else:
        dim, start, stop = cut
        if dim >= len(shape) or stop > shape[dim]:
            raise ModelLoadError(
                f"weight {name!r} has shape {shape}; rank {plan.rank} of {plan.degree} "
                f"needs rows {start}:{stop} of dim {dim} (does config.json match the weights?)"
            )
        tensor = part[start:stop] if dim == 0 else part[:, start:stop]
    return torch.zeros_like(tensor) if plan.zeroed(name) else tensor
