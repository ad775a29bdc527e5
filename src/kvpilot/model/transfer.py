"""Moving KV blocks between the device pool, a host pool and bytes, off the step loop.

Implements `kvpilot.engine.executor.TierTransport`. The host pool is block-major,
``[num_host_blocks, L, 2, B, H_kv, D]``, so each host block is one contiguous run of bytes.
On CUDA it is pinned memory and is itself the source or target of every copy:

    swap out:  device pool --gather (device)--> device staging [n, L, 2, B, H, D]
               --non_blocking copy, one per run of consecutive host ids--> pinned host pool
    swap in:   pinned host pool --non_blocking copy per run--> device staging
               --scatter (device)--> device pool

All of it runs on a copy stream that first waits for the compute stream's queued work, so
the copies overlap the model's next steps; the copier thread (not the step loop) waits for
the stream. No pageable temporary is involved on CUDA. On CPU the same code runs as plain
memcpys on the copier thread (torch releases the GIL). Each copy resolves to the seconds it
took, which the engine feeds to its bandwidth meters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvpilot.errors import ConfigError
from kvpilot.model.kv_cache import KVCache, poison_blocks


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``ids``, first id, length) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, int(ids[start]), i - start))
            start = i
    return runs


class TorchTierTransport:
    def __init__(self, cache: KVCache, num_host_blocks: int) -> None:
        if num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.cache = cache
        self.device = cache.data.device
        self.num_host_blocks = num_host_blocks
        self.block_bytes = cache.bytes_per_block
        layers, kv, _, *block = cache.data.shape
        self._block_shape = (layers, kv, *block)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(
            (max(num_host_blocks, 1), *self._block_shape),
            dtype=cache.data.dtype,
            pin_memory=cuda,
        )
        self._stream = torch.cuda.Stream(self.device) if cuda else None
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

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([int(i) for i in ids], dtype=torch.long, device=self.device)

    def _gather(self, dev: torch.Tensor) -> torch.Tensor:
        """Device blocks as a block-major device tensor [n, L, 2, B, H, D] (one kernel)."""
        return self.cache.data.index_select(2, dev).movedim(2, 0).contiguous()

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        dev = self._index([d for d, _ in pairs])
        host_ids = [h for _, h in pairs]

        def copy() -> float:
            start = time.perf_counter()
            staged = self._gather(dev)
            for pos, first, n in contiguous_runs(host_ids):
                self.host[first : first + n].copy_(staged[pos : pos + n], non_blocking=True)
            return time.perf_counter() - start

        return self._submit(copy)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Future[float]:
        host_ids = [h for h, _ in pairs]
        dev = self._index([d for _, d in pairs])

        def copy() -> float:
            start = time.perf_counter()
            staged = torch.empty(
                (len(pairs), *self._block_shape), dtype=self.host.dtype, device=self.device
            )
            for pos, first, n in contiguous_runs(host_ids):
                staged[pos : pos + n].copy_(self.host[first : first + n], non_blocking=True)
            self.cache.data.index_copy_(2, dev, staged.movedim(0, 2))
            return time.perf_counter() - start

        return self._submit(copy)

    def read_device(self, blocks: Sequence[int]) -> Future[list[bytes]]:
        dev = self._index(blocks)

        def read() -> list[bytes]:
            staged = self._gather(dev)
            if staged.is_cuda:
                pinned = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                pinned.copy_(staged, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
                staged = pinned
            if staged.dtype == torch.bfloat16:
                staged = staged.view(torch.int16)
            arr = staged.numpy()
            return [arr[i].tobytes() for i in range(len(blocks))]

        return self._submit(read)

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Future[float]:
        dev = self._index(blocks)
        dtype = self.cache.data.dtype

        def write() -> float:
            start = time.perf_counter()
            view_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
            cuda = self.device.type == "cuda"
            staged = torch.empty(
                (len(blocks), *self._block_shape), dtype=view_dtype, pin_memory=cuda
            )
            for i, d in enumerate(data):
                # The disk store's blocks are writable views: read in place, no copy first.
                src = d if isinstance(d, memoryview) and not d.readonly else bytearray(d)
                staged[i].copy_(torch.frombuffer(src, dtype=view_dtype).view(staged[i].shape))
            if dtype == torch.bfloat16:
                staged = staged.view(torch.bfloat16)
            on_device = staged.to(self.device, non_blocking=True)
            self.cache.data.index_copy_(2, dev, on_device.movedim(0, 2))
            return time.perf_counter() - start

        return self._submit(write)

    def poison_host(self, blocks: Sequence[int]) -> None:
        # Freed host blocks have no copy in flight (copies pin their blocks until done).
        if blocks:
            index = torch.tensor([int(b) for b in blocks], dtype=torch.long)
            poison_blocks(self.host.movedim(0, 2), index)  # host blocks are dim 0 here

    def close(self) -> None:
        self._copier.shutdown(wait=True)
