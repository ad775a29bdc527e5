"""The replica side of the fleet: an engine's KV events, snapshots and load reports.

`ReplicaAgent` attaches a `KVEventLog` to the engine's radix cache and reads the engine's
queue and meters into a `ReplicaLoad`. The Ray Serve replica deployment and the fleet
simulator both use it, so the directory sees the same events either way. Call it only
where the engine is touched (the engine thread, or the simulator's loop).
"""

from __future__ import annotations

from kvpilot.engine.engine import Engine
from kvpilot.fleet.events import EventBatch, KVEventLog, ReplicaSnapshot
from kvpilot.fleet.keys import KeySpace
from kvpilot.fleet.load import DEFAULT_PREFILL_TOKENS_PER_S, ReplicaLoad


def engine_key_space_id(engine: Engine) -> str:
    """The seed this engine hashes blocks under (its radix root for the anonymous tenant,
    so the model fingerprint, wherever the engine puts one, is part of it)."""
    return engine.kv.radix.root(None).last_hash().hex()


class ReplicaAgent:
    def __init__(self, engine: Engine, name: str, event_capacity: int = 65536) -> None:
        self.engine = engine
        self.name = name
        self.log = KVEventLog(engine.kv.radix, capacity=event_capacity)
        self.key_space_id = engine_key_space_id(engine)
        self.key_space = KeySpace.of_radix(engine.kv.radix)

    @property
    def epoch(self) -> str:
        return self.log.epoch

    def events_since(self, after_seq: int, epoch: str | None) -> EventBatch | None:
        return self.log.since(after_seq, epoch)

    def snapshot(self) -> ReplicaSnapshot:
        return self.log.snapshot(self.key_space_id)

    def load(self) -> ReplicaLoad:
        engine = self.engine
        sched = engine.scheduler
        waiting_tokens = 0
        for seq in sched.waiting:
            traj = seq.traj
            waiting_tokens += len(traj.tokens) - traj.num_computed_tokens
        for seq in sched.running:
            traj = seq.traj
            waiting_tokens += max(0, len(traj.tokens) - traj.num_computed_tokens - 1)
        offload = engine.offload
        mover = offload.mover
        has_tiers = mover.block_bytes > 0
        return ReplicaLoad(
            time_s=engine.clock.now(),
            waiting_tokens=waiting_tokens,
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_usage=sched.held_usage(),
            prefill_tokens_per_s=offload.prefill.tokens_per_s(0, DEFAULT_PREFILL_TOKENS_PER_S),
            device_host_bw_bytes_s=mover.link_bw() if has_tiers else 0.0,
            host_disk_bw_bytes_s=mover.disk_bw() if offload.disk is not None else 0.0,
            block_bytes=float(mover.block_bytes),
            block_size=engine.kv.block_size,
        )
