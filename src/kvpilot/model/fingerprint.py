"""The model fingerprint: what a KV block's chained hash is seeded with, so keys never mix models.

Two checkpoints of the same shape (other weights, or the same weights saved in another
dtype) must never read each other's KV from a shared disk tier. The fingerprint hashes:

- the weights' identity, cheaply: each safetensors file's header (tensor names, dtypes,
  shapes, offsets, metadata) and 64 evenly spaced 64-byte samples of its data, plus the shard
  index when there is one (reading every byte of a 100 GB checkpoint at start-up is not
  cheap; two different trainings or dtypes differ in the header or in nearly every sample);
- the parsed model config (anything that changes how KV is computed);
- the KV dtype and the block size (the layout of a block's bytes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from hashlib import blake2b
from pathlib import Path

import torch

from kvpilot.memory.hashing import HASH_BYTES, ModelFingerprint
from kvpilot.model.config import ModelConfig
from kvpilot.model.loader import SHARD_INDEX, weight_files

SAMPLES_PER_FILE = 64
SAMPLE_BYTES = 64


def model_fingerprint(
    folder: Path, config: ModelConfig, kv_dtype: torch.dtype, block_size: int
) -> ModelFingerprint:
    h = blake2b(digest_size=HASH_BYTES, person=b"kvpilot-model")
    layout = {"kv_dtype": str(kv_dtype), "block_size": block_size}
    h.update(json.dumps(layout, sort_keys=True).encode())
    h.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    index = folder / SHARD_INDEX
    if index.is_file():
        h.update(index.read_bytes())
    for path in weight_files(folder):
        h.update(path.name.encode())
        h.update(_weights_identity(path))
    dtype = str(kv_dtype).removeprefix("torch.")
    label = f"{folder.name} ({config.model_type}, {dtype} KV, block size {block_size})"
    return ModelFingerprint(h.digest(), label)


def _weights_identity(path: Path) -> bytes:
    """A safetensors file's header and evenly spaced samples of its data."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        parts = [head, f.read(min(header_len, max(size - 8, 0)))]
        start = 8 + header_len
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // max(SAMPLES_PER_FILE - 1, 1))
            parts.append(f.read(SAMPLE_BYTES))
    return b"".join(parts)
