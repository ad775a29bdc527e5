"""`TensorParallelExecutor`: the engine's executor over ``degree`` ranks (rank 0 in-process).

The engine, its scheduler, memory core, pause policies and tier decisions stay single, in
this process, which is also rank 0. Ranks 1 .. degree - 1 are worker processes it spawns
(`kvpilot.model.parallel.worker`); every rank holds its own shard of the weights and its own
KV pool with the same block ids. Per step, rank 0 checks the works (building its batch),
broadcasts them once on the control group, and every rank runs its shard; the logits are
gathered on every rank and rank 0 samples.

Failure is loud, never a hang: before each command rank 0 checks that every worker is
alive, every collective of rank 0 has a timeout (``timeout_s``; ``startup_timeout_s`` while
the workers load their shards), and a collective that fails (a
dead peer closes its sockets at once) raises `TensorParallelError` naming the rank, its
exit code and the worker's own traceback when it sent one. After a failure the executor
refuses every call with the same error.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.executor import SeqWork, StepOutput
from kvpilot.errors import ConfigError, TensorParallelError
from kvpilot.model.config import ModelConfig
from kvpilot.model.fingerprint import model_fingerprint
from kvpilot.model.loader import LoadProgress, resolve_model_path
from kvpilot.model.memory_budget import DEFAULT_GPU_MEMORY_UTILIZATION
from kvpilot.model.parallel.comm import RankGroups, open_store
from kvpilot.model.parallel.plan import check_degree
from kvpilot.model.parallel.rank import RankShard, ShardSpec, to_wire
from kvpilot.model.parallel.worker import GATHERED_OPS, worker_main
from kvpilot.model.runner import (
    eos_token_ids,
    logits_by_seq,
    parse_device,
    parse_dtype,
    sample_step,
)
from kvpilot.model.sampler import Sampler
from kvpilot.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0  # one collective of a step or a tier move, on rank 0
DEFAULT_STARTUP_TIMEOUT_S = 1800.0  # workers start, join and load their shards
STOP_GRACE_S = 10.0


@dataclass(slots=True)
class _Worker:
    rank: int
    process: BaseProcess
    pipe: Connection
    message: str | None = None  # the worker's last report (its traceback on failure)

    def drain(self) -> None:
        try:
            while self.pipe.poll():
                kind, text = self.pipe.recv()
                if kind == "error":
                    self.message = text
        except (EOFError, OSError):
            pass


class TensorParallelExecutor:
    """Implements `kvpilot.engine.executor.Executor` over ``tensor_parallel_size`` ranks.

    Options as `ModelRunner`'s; ``num_blocks`` / ``kv_memory_bytes`` size each rank's pool
    (bytes: per rank, so a rank's block holds only its KV heads), and the pool has the same
    number of blocks on every rank (the fewest any rank fits). On CUDA rank r uses device
    ``cuda:r`` and NCCL; CUDA graphs are not used under tensor parallelism.
    """

    def __init__(
        self,
        model: str | Path,
        tensor_parallel_size: int,
        *,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        block_size: int = 16,
        dtype: str = "auto",
        device: str = "cpu",
        attention: str = "auto",
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        cache_dir: Path | None = None,
        progress: LoadProgress | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        if num_blocks is not None and kv_memory_bytes is not None:
            raise ConfigError("give num_blocks or kv_memory_bytes, not both")
        degree = tensor_parallel_size
        self.device = parse_device(device)
        if self.device.type == "cuda" and torch.cuda.device_count() < degree:
            raise ConfigError(
                f"tensor_parallel_size {degree} needs {degree} CUDA devices, "
                f"{torch.cuda.device_count()} are visible"
            )
        self.dtype = parse_dtype(dtype, self.device)
        self.path = resolve_model_path(model, cache_dir)
        self.config = ModelConfig.from_folder(self.path)
        check_degree(self.config, degree)
        self.degree = degree
        self.block_size = block_size
        self.timeout_s = timeout_s
        spec = ShardSpec(
            path=self.path,
            degree=degree,
            device=self.device.type,
            dtype=self.dtype,
            attention=attention,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            startup_timeout_s=startup_timeout_s,
            threads=max(1, (os.cpu_count() or 1) // degree),
        )
        self._lock = threading.Lock()
        self._error: TensorParallelError | None = None
        self._closed = False
        self._workers: list[_Worker] = []
        self.startup_timeout_s = startup_timeout_s
        store = open_store(0, 0, degree, startup_timeout_s)
        try:
            self._spawn(spec, store.port)
            if progress is not None:
                progress.step("tokenizer")
            self.tokenizer: Any = load_tokenizer(self.path)
            self._await_started()
            if progress is not None:
                progress.step("weights")
            with self._guard():
                device0 = spec.device_of(0)
                self.groups = RankGroups(store, 0, degree, device0, startup_timeout_s)
                self.shard = RankShard(spec, 0, self.groups)
                self.groups.set_timeout(timeout_s)
        except BaseException:
            self._stop_workers(grace_s=0.0)
            raise
        if progress is not None:
            progress.step("kv_pool")
        self.num_blocks = self.shard.num_blocks
        self.max_model_len = self.shard.max_model_len
        self.fingerprint = model_fingerprint(self.path, self.config, self.dtype, block_size)
        self.eos_token_ids = eos_token_ids(self.path, self.config, self.tokenizer)
        self.sampler = Sampler()

    # -- what the engine reads ---------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all ranks (each rank holds ``shard_block_bytes``)."""
        return self.shard.shard_block_bytes * self.degree

    @property
    def shard_block_bytes(self) -> int:
        return self.shard.shard_block_bytes

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    # -- the Executor protocol ---------------------------------------------------------

    def _run(self, works: Sequence[SeqWork], wanted: Sequence[int]) -> torch.Tensor | None:
        batch = self.shard.prepare(works, wanted)  # a bad work fails here, before broadcast
        with self._guard():
            self.groups.broadcast_object(("step", (to_wire(works), list(wanted))))
            return self.shard.run(batch, bool(wanted))

    @torch.inference_mode()
    def compute_logits(self, works: Sequence[SeqWork]) -> dict[int, torch.Tensor]:
        """fp32 logits of each work's last position, by seq_id (computes and stores KV too)."""
        return logits_by_seq(works, self._run)

    @torch.inference_mode()
    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        return sample_step(works, self._run, self.sampler)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.command("copy_blocks", list(pairs), local_first=True)

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.command("poison_blocks", list(blocks), local_first=True)

    # -- commands ----------------------------------------------------------------------

    def command(self, op: str, payload: Any, *, local_first: bool = False) -> list[Any]:
        """Run ``op`` on every rank; every rank's result (gathered ops) or rank 0's alone.

        ``local_first``: rank 0 runs it before broadcasting (an op it refuses never reaches
        the workers); otherwise the workers start while rank 0 runs its own part.
        """
        with self._guard():
            local = self.shard.handle(op, payload) if local_first else None
            self.groups.broadcast_object((op, payload))
            if not local_first:
                local = self.shard.handle(op, payload)
            if op in GATHERED_OPS:
                return list(self.groups.gather_objects(local))
            return [local]

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """One caller at a time; a failed collective becomes `TensorParallelError`."""
        with self._lock:
            self._check_usable()
            try:
                yield
            except TensorParallelError:
                raise
            except RuntimeError as exc:  # gloo/NCCL: a peer broke off or timed out
                raise self._fail(str(exc)) from exc

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TensorParallelError("this tensor-parallel executor is closed")
        if any(not w.process.is_alive() for w in self._workers):
            raise self._fail("a worker is gone")

    def _fail(self, cause: str) -> TensorParallelError:
        """The error of a failed collective or a dead worker; the workers are stopped."""
        deadline = time.monotonic() + 2.0  # a peer that broke the collective is exiting
        while time.monotonic() < deadline and all(w.process.is_alive() for w in self._workers):
            time.sleep(0.05)
        dead = [w for w in self._workers if not w.process.is_alive()]
        for w in self._workers:
            w.drain()
        for w in self._workers:
            if w.message:
                log.error("tensor-parallel worker rank %d failed:\n%s", w.rank, w.message)
        if dead:
            w = dead[0]
            detail = (w.message or "").strip().splitlines()
            said = f": {detail[-1]}" if detail else " (killed, or it crashed without a report)"
            error = TensorParallelError(
                f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) exited with code "
                f"{w.process.exitcode}{said}; the engine cannot continue: restart it"
            )
        else:
            error = TensorParallelError(
                f"a tensor-parallel collective failed ({cause}); a rank did not answer within "
                f"{self.timeout_s:g} s or broke off; the engine cannot continue: restart it"
            )
        self._error = error
        self._stop_workers(grace_s=0.0)
        return error

    # -- workers -----------------------------------------------------------------------

    def _spawn(self, spec: ShardSpec, port: int) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(1, self.degree):
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=worker_main,
                args=(spec, rank, port, send),
                name=f"kvpilot-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            send.close()
            self._workers.append(_Worker(rank, process, receive))

    def _await_started(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for w in self._workers:
            while not w.pipe.poll(0.1):
                if not w.process.is_alive() or time.monotonic() > deadline:
                    raise self._fail("a worker did not start")
            kind, text = w.pipe.recv()
            if kind != "started":
                w.message = text
                raise self._fail("a worker failed to start")

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5.0)
            w.pipe.close()
        groups = getattr(self, "groups", None)
        if groups is not None:
            groups.close()

    def close(self) -> None:
        """Tell the workers to stop, wait for them (then kill stragglers); idempotent."""
        if self._closed:
            return
        with self._lock:
            if self._error is None and all(w.process.is_alive() for w in self._workers):
                with contextlib.suppress(RuntimeError):  # stopping anyway
                    self.groups.broadcast_object(("shutdown", None))
            self._closed = True
            if self._error is None:
                self._stop_workers(grace_s=STOP_GRACE_S)

    def __enter__(self) -> TensorParallelExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
