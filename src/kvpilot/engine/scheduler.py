"""Continuous batching under a token budget, with chunked prefill, admission and preemption.

Torch-free: the real engine and the simulator drive this same code.

One step, in order (the spec's token-budget scheduling, eq. in "Token-budget scheduling"):

1. Running sequences, oldest admission first: a decode costs one token, an unfinished
   prefill takes a chunk of at most ``max_prefill_chunk`` tokens, until the budget is spent.
   A sequence that cannot get a KV block first makes idle session state give way, then
   preempts sequences admitted after it (possibly itself, last): with a ``preempt_cost``
   hook the one cheapest to bring back per block it frees, else the most recently admitted.
   A victim is swapped to the host tier when the ``swap_out`` hook says so, else its
   committed prefix stays in the prefix cache and the rest is recomputed. Victims go back
   to the *front* of the waiting queue, so no request starves. A sequence alone in the
   pool that still cannot grow waits while tier copies in flight pin blocks (they come free
   when the copies finish); with none in flight it is ended (``starved``).
2. Waiting sequences, preempted ones first, then by the device-resident prefix they had on
   arrival, longest first (ties: first come first served), while KV usage (a hybrid model's
   fuller pool) is below ``tau_high``, blocks are available and the budget lasts; a
   ``defer_admission`` hook may hold one back (others are admitted past it). On admission a
   sequence reuses the longest cached prefix of its tokens from the radix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.executor import SeqWork
from kvpilot.engine.request import RUNNING, WAITING, SeqStatus, Sequence
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.errors import OutOfBlocks
from kvpilot.memory import KVManager, Trajectory
from kvpilot.memory.residency import LOADING, READY, Residency
from kvpilot.memory.tiers import DEVICE

# `SeqWork(...)` and `SchedulerOutput(...)` without the named tuples' generated ``__new__``
# (a Python function that calls just this): a work is built per running sequence per step.
_new_tuple = tuple.__new__


@dataclass(frozen=True, slots=True)
class AdmissionHooks:
    """What the scheduler asks of the rest of the engine; each hook is optional.

    ``reclaim_idle(blocks_wanted)`` makes idle (between-turn) session state give way and
    returns how many trajectories released KV. ``ensure_resident(traj)`` says whether the
    trajectory's cached prefix is on the device (starting a load from host or disk if not):
    a sequence whose prefix is still coming back waits, others are admitted past it.
    ``on_admit(seq)`` is told of every admission (after the prefix is reused).
    ``preempt_cost(seq)`` prices a victim: seconds to bring it back per block it frees.
    ``swap_out(seq)`` releases a victim's KV to the host tier when that beats recompute, and
    says whether it did (`kvpilot.engine.preemption.SwapPreemption`).
    ``copies_in_flight()`` says whether tier copies pin blocks that will come free, so that
    a sequence alone in the pool waits for them rather than ending short
    (`kvpilot.engine.offload.OffloadManager.busy`).
    ``defer_admission(seq)`` holds a waiting sequence back this step, others are admitted
    past it (`kvpilot.engine.admission.HotStateGuard`). ``window_room(seq, running)`` says
    whether a hybrid model's window pool has room for ``seq`` beside the running sequences;
    if not, admission stops this step unless nothing runs
    (`kvpilot.engine.admission.WindowAdmission`).
    """

    reclaim_idle: Callable[[int], int] | None = None
    ensure_resident: Callable[[Trajectory], Residency] | None = None
    on_admit: Callable[[Sequence], None] | None = None
    preempt_cost: Callable[[Sequence], float] | None = None
    swap_out: Callable[[Sequence], bool] | None = None
    defer_admission: Callable[[Sequence], bool] | None = None
    window_room: Callable[[Sequence, list[Sequence]], bool] | None = None
    copies_in_flight: Callable[[], bool] | None = None


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVManager, hooks: AdmissionHooks | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # of num_preemptions: KV swapped to host
        hooks = hooks or AdmissionHooks()
        self.reclaim_idle = hooks.reclaim_idle
        self.ensure_resident = hooks.ensure_resident
        self.on_admit = hooks.on_admit
        self.preempt_cost = hooks.preempt_cost
        self.swap_out = hooks.swap_out
        self.defer_admission = hooks.defer_admission
        self.window_room = hooks.window_room
        self.copies_in_flight = hooks.copies_in_flight
        self.held_back: set[int] = set()  # seq_ids the last step held back from admission
        self.num_deferred_admissions = 0  # sequences ever held back
        # Device-resident prefix blocks of each waiting sequence when it arrived (`add`).
        self.resident_at_add: dict[int, int] = {}

    # -- queue management -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence with at least as long a device-resident
        prefix (SGLang's "lpm"; preempted ones stay ahead of all): admitting a request with
        little cached before one whose prefix is resident would evict that prefix, and both
        would recompute. Measured once, on arrival (a few dict lookups per block)."""
        seq.status = WAITING
        waiting = self.waiting
        if not self.config.enable_prefix_caching or not waiting:
            self.resident_at_add[seq.seq_id] = 0
            waiting.append(seq)
            return
        traj = seq.traj
        tokens = traj.token_array()  # peek at all but the last token: length=, not a sliced copy
        peek = self.kv.radix.peek(tokens, traj.salt, below=traj.locked_node, length=len(tokens) - 1)
        resident = peek.blocks_by_tier.get(DEVICE, 0)  # at least the blocks it holds:
        if resident < len(traj.block_table):  # max() as a comparison (a keyword-parsing call)
            resident = len(traj.block_table)
        self.resident_at_add[seq.seq_id] = resident
        at = len(waiting)
        while at > 0 and self.resident_at_add.get(waiting[at - 1].seq_id, resident) < resident:
            at -= 1
        waiting.insert(at, seq)

    def remove(self, seq: Sequence) -> None:
        self.resident_at_add.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def held_usage(self) -> float:
        """Device KV usage counting only blocks that cannot be evicted right now; with a
        sliding-window pool (hybrid models), of the fuller pool: either one running out
        stops new work."""
        total = self.kv.device.num_blocks
        usage = (total - self.kv.free_blocks()) / total
        window = self.kv.window
        return usage if window is None else max(usage, window.held_usage())

    def memory_pressure(self) -> float:
        """Shadow price of device memory: 1 while work waits, else usage against tau_high."""
        for seq in self.waiting:  # any(...) would set up a generator per pause
            if seq.prefix_reused:
                return 1.0
        ratio = self.held_usage() / self.config.tau_high
        return ratio if ratio < 1.0 else 1.0  # min(1.0, ratio), per pause, without the call

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:  # hot path: once per engine step
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs: list[Sequence] = []
        works: list[SeqWork] = []
        preempted: list[Sequence] = []
        starved: list[Sequence] = []
        prefill = context = 0
        running = self.running
        block = self.kv.block_size

        # Removing sequences after the current one (victims of a preemption) is safe while
        # iterating: the loop ends at once whenever it removes the current one or an earlier.
        for seq in running:
            if budget <= 0:
                break
            traj = seq.traj
            computed = traj.num_computed_tokens
            remaining = len(traj.tokens) - computed
            # A decode takes its one token (the budget is positive), a prefill its chunk.
            n = 1 if remaining == 1 else self._chunk_of(remaining, budget)
            # Most decode steps need no new block: `_try_allocate`'s own first test, inline.
            if computed + n > len(traj.block_table) * block and not self._try_allocate(seq, n):
                if len(running) == 1:
                    if self.copies_in_flight is not None and self.copies_in_flight():
                        break  # blocks pinned by copies come free when they finish: wait
                    running.remove(seq)
                    starved.append(seq)
                    break
                if not self._preempt_until_allocated(seq, n, preempted):
                    break  # seq preempted itself: everything after it is gone too
            seqs.append(seq)
            # `_work`, inline (the hot path: every running sequence, every step).
            req = seq.request
            params = req.params
            window = traj.window
            works.append(
                _new_tuple(  # a SeqWork of its fields in order (`_new_tuple`)
                    SeqWork,
                    (
                        seq.seq_id,
                        traj.tokens[computed : computed + n],  # int32: a slice is a memcpy
                        computed,
                        traj.block_table,
                        params if n == remaining else None,
                        len(seq.output_token_ids),
                        seq.seed,
                        params.n if (params.n > 1 and not req.forked) else 1,
                        None if window is None else window.blocks,
                    ),
                )
            )
            if n > 1 or n != remaining:
                prefill += n
            if computed + n > context:
                context = computed + n
            budget -= n

        if self.waiting and not preempted:  # a preemption admits nothing this step
            budget, prefill, context = self._admit(seqs, works, budget, prefill, context)
        elif self.held_back:
            self.held_back = set()  # nothing was held back this step

        total = cfg.max_num_batched_tokens - budget
        return _new_tuple(
            SchedulerOutput,
            (seqs, works, preempted, starved, total, prefill, total - prefill, context),
        )

    def _admit(
        self, seqs: list[Sequence], works: list[SeqWork], budget: int, prefill: int, context: int
    ) -> tuple[int, int, int]:
        """Step 2 (see the module docstring): admit waiting sequences into ``seqs``/``works``
        while the budget lasts; returns the budget, prefill tokens and context after them.
        Not called with nothing waiting (a third of all steps continue a prefill then)."""
        cfg = self.config
        i = 0
        held_back = self.held_back
        self.held_back = set()
        while i < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[i]
            if self.defer_admission is not None and self.defer_admission(seq):
                self.held_back.add(seq.seq_id)
                self.num_deferred_admissions += seq.seq_id not in held_back
                i += 1
                continue
            if self.held_usage() >= cfg.tau_high and not self._make_room():
                break
            if self.window_room and self.running and not self.window_room(seq, self.running):
                break
            if self.ensure_resident is not None and not self._resident(seq):
                i += 1
                continue
            if cfg.enable_prefix_caching:
                seq.traj.reuse_prefix(record=not seq.prefix_reused)
            seq.prefix_reused = True
            traj = seq.traj
            remaining = len(traj.tokens) - traj.num_computed_tokens
            n = self._chunk_of(remaining, budget)
            if not self._try_allocate(seq, n):
                break
            if seq.index == 0 and seq.num_preemptions == 0 and not seq.output_token_ids:
                seq.request.cached_tokens = traj.num_computed_tokens
            if self.on_admit is not None:
                self.on_admit(seq)
            del self.waiting[i]
            self.resident_at_add.pop(seq.seq_id, None)
            seq.status = RUNNING
            self.running.append(seq)
            sample = n == len(traj.tokens) - traj.num_computed_tokens
            seqs.append(seq)
            works.append(self._work(seq, n, sample))
            if n > 1 or not sample:
                prefill += n
            if traj.num_computed_tokens + n > context:
                context = traj.num_computed_tokens + n
            budget -= n
        return budget, prefill, context

    def _resident(self, seq: Sequence) -> bool:
        """Ready when the prefix is device-resident; short of room to load it, idle sessions
        give way, then (with nothing running) other waiting work does."""
        assert self.ensure_resident is not None
        while True:
            state = self.ensure_resident(seq.traj)
            if state is READY:
                return True
            if state is LOADING:
                return False  # its load is in flight
            if self.reclaim_idle is not None and self.reclaim_idle(0):
                continue
            if not self.running and self.release_waiting(seq):
                continue
            return False

    def _make_room(self) -> bool:
        """Usage is at tau_high: idle session state gives way first. With nothing running,
        admit anyway, so that sessions holding memory can never block their own next turns."""
        if self.reclaim_idle is not None and self.reclaim_idle(1):
            return self.held_usage() < self.config.tau_high or not self.running
        return not self.running

    def _chunk_of(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step of ``remaining`` within ``budget``."""
        cfg = self.config
        if not cfg.chunked_prefill:
            return remaining
        # max(1, min(remaining, chunk, budget)) as comparisons: the builtins parse their
        # arguments as keywords (~1.8k instructions a call), once per prefill chunk.
        chunk = cfg.max_prefill_chunk
        n = remaining if remaining < chunk else chunk
        if budget < n:
            n = budget
        return n if n > 1 else 1

    def _try_allocate(self, seq: Sequence, n: int) -> bool:
        """Allocate blocks for n more tokens; idle sessions, then waiting work, give way first."""
        traj = seq.traj
        if traj.num_computed_tokens + n <= len(traj.block_table) * self.kv.block_size:
            return True  # hot path: most decode steps need no new block
        while True:
            try:
                seq.traj.allocate(n)
                return True
            except OutOfBlocks:
                wanted = seq.traj.blocks_needed(n)
                if self.reclaim_idle is not None and self.reclaim_idle(wanted):
                    continue
                if not self.release_waiting(seq):
                    return False

    def release_waiting(self, keep: Sequence) -> bool:
        """Drop the KV a waiting sequence holds (the latest first): it recomputes or reloads."""
        for other in reversed(self.waiting):
            if other is not keep and other.traj.block_table:
                other.traj.release_kv(keep_in_cache=self.config.enable_prefix_caching)
                return True
        return False

    def _preempt_until_allocated(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Preempt sequences admitted after ``seq``, then ``seq``, until it gets its blocks."""
        while True:
            victim = self._victim(seq)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
            if self._try_allocate(seq, n):
                return True

    def _victim(self, seq: Sequence) -> Sequence:
        """Of the sequences admitted after ``seq``: the cheapest to bring back per block it
        frees (ties: the latest), or the latest without a price. ``seq`` when none is left."""
        later = self.running[self.running.index(seq) + 1 :]
        if not later:
            return seq
        if self.preempt_cost is None:
            return later[-1]
        return min(reversed(later), key=self.preempt_cost)

    def _preempt(self, seq: Sequence) -> None:
        caching = self.config.enable_prefix_caching
        if caching and self.swap_out is not None and self.swap_out(seq):
            self.num_swapped_preemptions += 1
        seq.traj.release_kv(keep_in_cache=caching)  # no-op after a swap
        self.running.remove(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _work(self, seq: Sequence, num_tokens: int, sample: bool) -> SeqWork:
        traj = seq.traj
        start = traj.num_computed_tokens
        req = seq.request
        params = req.params
        window = traj.window
        return _new_tuple(
            SeqWork,
            (
                seq.seq_id,
                traj.tokens[start : start + num_tokens],  # int32: a slice is a memcpy
                start,
                traj.block_table,  # not copied: executors read it during the call only
                params if sample else None,
                len(seq.output_token_ids),
                seq.seed,
                params.n if (params.n > 1 and not req.forked) else 1,
                None if window is None else window.blocks,
            ),
        )

    def check_invariants(self) -> None:
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING, f"seq {seq.seq_id} in running is {seq.status}"
            assert seq.traj.num_computed_tokens <= len(seq.traj.tokens)
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING, f"seq {seq.seq_id} waiting is {seq.status}"
        assert len(set(map(id, self.running))) == len(self.running), "a sequence runs twice"
        # Preempted sequences (no arrival figure) first, then longest resident prefix first.
        keys = [self.resident_at_add.get(s.seq_id) for s in self.waiting]
        keyed = [k for k in keys if k is not None]
        assert keys[len(keys) - len(keyed) :] == keyed, "a preempted sequence behind new work"
        assert keyed == sorted(keyed, reverse=True), "waiting work out of prefix order"
