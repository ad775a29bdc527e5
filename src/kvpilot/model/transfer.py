"""Moving KV blocks between the device pool, a host pool and bytes, off the step loop.

Implements `kvpilot.engine.executor.TierTransport`. On CUDA the host pool is pinned
memory and copies run on their own stream (after the compute stream's writes), so they
overlap with the model's work; on CPU a background copier thread does the memcpy while the
step loop runs (torch releases the GIL for the copy). Each copy resolves to the seconds it
took, which the engine feeds to its bandwidth meters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvpilot.errors import ConfigError
from kvpilot.model.kv_cache import KVCache, poison_blocks


class TorchTierTransport:
    def __init__(self, cache: KVCache, num_host_blocks: int) -> None:
        if num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.cache = cache
        self.device = cache.data.device
        self.num_host_blocks = num_host_blocks
        self.block_bytes = cache.bytes_per_block
        shape = list(cache.data.shape)
        shape[2] = max(num_host_blocks, 1)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=cache.data.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._block_shape = (shape[0], shape[1], *shape[3:])
        self._np_dtype = (
            torch.empty((), dtype=cache.data.dtype).numpy().dtype
            if (cache.data.dtype != torch.bfloat16)
            else np.dtype(np.uint16)
        )
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-copy")

    # -- the copier --------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        def run() -> Any:
            with torch.inference_mode():
                if self._stream is None:
                    return fn()
                # Order after everything the compute stream has queued, then wait here (in
                # the copier thread, not the step loop) until the copy is done.
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
                with torch.cuda.stream(self._stream):
                    out = fn()
                self._stream.synchronize()
                return out

        return self._copier.submit(run)

    def _index(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor([int(i) for i in ids], dtype=torch.long, device=device)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        dev = self._index([d for d, _ in pairs], self.device)
        host = self._index([h for _, h in pairs], torch.device("cpu"))

        def copy() -> float:
            start = time.perf_counter()
            self.host[:, :, host] = self.cache.data[:, :, dev].to("cpu")
            return time.perf_counter() - start

        return self._submit(copy)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        host = self._index([h for h, _ in pairs], torch.device("cpu"))
        dev = self._index([d for _, d in pairs], self.device)

        def copy() -> float:
            start = time.perf_counter()
            staged = self.host[:, :, host]
            if self.device.type == "cuda":
                staged = staged.pin_memory().to(self.device, non_blocking=True)
            self.cache.data[:, :, dev] = staged
            return time.perf_counter() - start

        return self._submit(copy)

    def read_device(self, blocks: Sequence[int]) -> Future[list[bytes]]:
        dev = self._index(blocks, self.device)

        def read() -> list[bytes]:
            data = self.cache.data[:, :, dev].to("cpu")
            if data.dtype == torch.bfloat16:
                data = data.view(torch.int16)
            arr = data.numpy()
            return [np.ascontiguousarray(arr[:, :, i]).tobytes() for i in range(len(blocks))]

        return self._submit(read)

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Future[float]:
        dev = self._index(blocks, self.device)
        dtype = self.cache.data.dtype

        def write() -> float:
            start = time.perf_counter()
            view_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
            parts = [
                torch.frombuffer(bytearray(d), dtype=view_dtype).view(self._block_shape)
                for d in data
            ]
            stacked = torch.stack(parts, dim=2)
            if dtype == torch.bfloat16:
                stacked = stacked.view(torch.bfloat16)
            self.cache.data[:, :, dev] = stacked.to(self.device)
            return time.perf_counter() - start

        return self._submit(write)

    def poison_host(self, blocks: Sequence[int]) -> None:
        # Freed host blocks have no copy in flight (copies pin their blocks until done).
        if blocks:
            poison_blocks(self.host, self._index(blocks, torch.device("cpu")))

    def close(self) -> None:
        self._copier.shutdown(wait=True)
