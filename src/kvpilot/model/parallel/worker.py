"""The worker process of one tensor-parallel rank (1 .. degree - 1): load, then obey rank 0.

Started by `TensorParallelExecutor` (spawned, so CUDA works in it). It reports on its pipe
that it started, joins the process groups, loads its shard, and then runs every command
rank 0 broadcasts until told to shut down. On any failure it sends the traceback on the
pipe before exiting, so rank 0's error names the cause, not only the exit code.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection

GATHERED_OPS = frozenset({"read_device", "swap_out", "swap_in", "write_device"})
IDLE_WAIT_S = 30 * 24 * 3600.0  # a worker waits for the next command as long as rank 0 lives


def worker_main(spec: object, rank: int, port: int, conn: Connection) -> None:
    import torch

    from kvpilot.model.parallel.comm import RankGroups, open_store
    from kvpilot.model.parallel.rank import RankShard, ShardSpec

    assert isinstance(spec, ShardSpec)
    try:
        torch.set_num_threads(spec.threads)
        device = spec.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("started", None))
        store = open_store(port, rank, spec.degree, spec.startup_timeout_s)
        groups = RankGroups(store, rank, spec.degree, device, IDLE_WAIT_S)
        shard = RankShard(spec, rank, groups)
        while True:
            op, payload = groups.broadcast_object()
            if op == "shutdown":
                break
            result = shard.handle(op, payload)
            if op in GATHERED_OPS:
                groups.gather_objects(result)
        if shard.transport is not None:
            shard.transport.close()
        groups.close()
        conn.send(("stopped", None))
    except BaseException:  # reported to rank 0, then the process exits
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            raise SystemExit(1) from None
