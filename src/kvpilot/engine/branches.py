"""Branches of a request with ``n`` > 1: the prompt is prefilled once, then forked.

Each branch is a fork of the parent's trajectory (its full blocks shared through the
radix, its partial tail copied on write), or, under memory pressure (``gated``) or when no
block is left for the tail, a deferred child that waits in the queue and recomputes only
its tail from the cache (`KVManager.fork_or_defer`).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpilot.engine.executor import Executor, WindowExecutor
from kvpilot.engine.request import RUNNING, Sequence
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.stats import EngineStats
from kvpilot.memory import ForkResult, KVManager


def fork_branches(
    parent: Sequence,
    n: int,
    kv: KVManager,
    scheduler: Scheduler,
    executor: Executor,
    stats: EngineStats,
    *,
    gated: bool,
    seq_ids: Iterator[int],
) -> list[Sequence]:
    """``n`` branches of ``parent`` (indices 1..n), scheduled: a fork runs at once, a
    deferred child waits for admission. Speculative branches are gated first under pressure:
    past tau_high they wait in the queue instead of running now."""
    request = parent.request
    request.forked = True
    forks: list[ForkResult] = []
    children: list[Sequence] = []
    for index in range(1, n + 1):
        fork = kv.fork_or_defer(parent.traj, defer=gated)
        if fork.deferred:
            stats.gated_forks += 1
        forks.append(fork)
        child = Sequence(next(seq_ids), request, fork.child, index=index, seed=request.seed + index)
        child.prefix_reused = fork.child.num_computed_tokens > 0
        request.seqs.append(child)
        children.append(child)
        stats.forks += 1
    copy_forked_tails(executor, forks, stats)
    for child in children:
        if child.traj.num_computed_tokens:
            child.status = RUNNING
            scheduler.running.append(child)
        else:
            scheduler.add(child)
    return children


def copy_forked_tails(executor: Executor, forks: list[ForkResult], stats: EngineStats) -> None:
    """The copy-on-write copies of the forks' partial tails, in every layer group."""
    copies = [f.copy for f in forks if f.copy is not None]
    if copies:
        executor.copy_blocks(copies)
        stats.fork_copied_blocks += len(copies)
    window = [f.window_copy for f in forks if f.window_copy is not None]
    if window:
        assert isinstance(executor, WindowExecutor), "a window group needs a WindowExecutor"
        executor.copy_window_blocks(window)
