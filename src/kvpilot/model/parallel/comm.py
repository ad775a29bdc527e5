"""The collectives of one tensor-parallel rank, on process groups of its own.

Two groups over one TCP store (rank 0 hosts it): ``device`` carries activations (NCCL on
CUDA, gloo on CPU) and ``control`` (always gloo, CPU tensors) carries each step's metadata
and the KV bytes of disk moves. The groups are built directly (not torch.distributed's
global default group), so an engine owns its groups and closing it leaves no global state.
Every collective has the timeout given here: a rank that stops answering fails the
collective instead of hanging it, and a rank that died fails it at once (its sockets close).
Rank 0 uses a long timeout while the shards load, then the step timeout; the workers wait
for rank 0's next command as long as it takes (an idle server sends none), and fail at once
when rank 0's process is gone.
"""

from __future__ import annotations

import contextlib
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

LOCALHOST = "127.0.0.1"


def open_store(port: int, rank: int, degree: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (``port`` 0 picks a free one: read ``store.port``)."""
    return dist.TCPStore(
        LOCALHOST,
        port,
        degree,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class RankGroups:
    def __init__(
        self,
        store: dist.TCPStore,
        rank: int,
        degree: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.degree = degree
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        self.store = store
        self.control: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, degree, timeout
        )
        if device.type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no NCCL")
            options = nccl.Options()
            options._timeout = timeout
            self.device_group: Any = nccl(dist.PrefixStore("device", store), rank, degree, options)
        else:
            self.device_group = self.control

    # -- activations (device group) ----------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.degree)]
        self.device_group.allgather([out], [tensor]).wait()
        return out

    # -- metadata and bytes (control group, CPU) ---------------------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; two broadcasts: length, then bytes)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.control.broadcast(length, 0).wait()
        n = int(length.item())
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(n, dtype=torch.uint8)
        )
        self.control.broadcast(buf, 0).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.degree)]
        self.control.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.degree)]
        self.control.allgather([bufs], [buf]).wait()
        return [
            pickle.loads(b[: int(s.item())].numpy().tobytes())
            for b, s in zip(bufs, sizes, strict=True)
        ]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs want ReduceOp
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    def set_timeout(self, timeout_s: float) -> None:
        """The timeout of every later collective on this rank."""
        for group in {id(g): g for g in (self.device_group, self.control)}.values():
            set_timeout = getattr(group, "set_timeout", None)  # NCCL keeps its own watchdog
            if set_timeout is not None:
                set_timeout(timedelta(seconds=timeout_s))

    def close(self) -> None:
        for group in {id(g): g for g in (self.device_group, self.control)}.values():
            with contextlib.suppress(RuntimeError):  # a group whose peer died may refuse
                group.shutdown()
