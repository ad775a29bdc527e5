"""Uniform decode runs: many decode-only steps of the engine advanced at once.

Between events, a batch in which every running sequence decodes changes predictably: each
step every sequence appends one token, now and then crosses into a new block, and fills
one; the step's time follows from the positions. `advance_decode_run(engine, until)` does
``k`` such steps in one call with the same result as ``k`` calls of `Engine.step()`: the
same tokens and token times, the same blocks allocated in the same order, the same radix
commits at the same clock times, the same telemetry, counters and offload polls. Per step
it only moves the clock, polls the offload manager, and allocates or commits where a block
boundary falls; the per-token work is done per sequence, in bulk.

It returns 0 (and changes nothing) unless the next step is such a step:

- every running sequence decodes (one token left to compute), the step's budget covers
  them all, and no waiting sequence could be admitted (nothing waits, or the batch is at
  ``max_num_seqs`` or uses the whole token budget);
- every block the run needs is free or evictable from the prefix cache (a run allocates,
  and so evicts, at the same steps and in the same order as `Engine.step`);
- no tier copy is in flight and no offload timer is due;
- the executor implements `DecodeRunExecutor` and the clock can `move` (a `VirtualClock`);
- the model keeps no sliding-window pool (its window tables slide at every step).

``k`` ends before the step that samples a stop token (finishing on one is left to
`Engine.step`), before the pool would run out of free and evictable blocks (preemption is
left to `Engine.step`), and before the step that would start at or after ``until`` (the
caller's next event). The step that samples a sequence's last token (``max_tokens``, the
model's length) ends the run too: it is left to `Engine.step` as well, unless the caller
collects finished requests (``finished``) and every sequence finishing there is a session
turn (finishing one only marks it done; closing a trajectory could change how later
sequences of the same step commit). Then that step is the run's last, and it finishes
those sequences and their requests exactly as `Engine.step` does. A caller that looks at
the engine between steps (the simulator's telemetry samples) need not end runs for that: a
`RunLookout` looks inside the run, where the engine's gauges are those stepping would show.

    step:     0        1        2              k-1        k
    time:   s_0 ---> s_1 ---> s_2 --- ... ---> s_{k-1} ---> s_k      s_j < until for j < k
                 dt_0     dt_1                      dt_{k-1}
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import TYPE_CHECKING

from kvpilot.engine.run_protocols import RunLookout
from kvpilot.memory.tiers import DEVICE

if TYPE_CHECKING:
    from kvpilot.engine.engine import Engine
    from kvpilot.engine.request import RequestOutput
    from kvpilot.engine.request import Sequence as Seq
    from kvpilot.memory import Trajectory

MAX_RUN_STEPS = 4096


def _blocks_needed(k: int, firsts: list[int], block: int) -> int:
    """Blocks the first ``k`` steps of a run allocate, sequence ``i`` one at each of the steps
    ``firsts[i], firsts[i] + block, ...``."""
    return sum([(k - first - 1) // block + 1 for first in firsts if first < k])


def _extends_in_place(traj: Trajectory) -> bool:
    """Whether the trajectory's commits grow its locked node in place (`RadixCache.
    extend_leaf`: a non-root leaf with a device copy only, locked by it alone). Then only its
    last commit of a run leaves a trace (the node's blocks and access time); otherwise its
    first commit (a new node, queued for eviction at that time) matters too."""
    node = traj.locked_node
    return (
        node.depth_tokens > 0  # not the root (is_root without its property call)
        and not node.children
        and node.lock_count == 1
        and len(node.blocks) == 1
        and DEVICE in node.blocks
    )


def _session_turn(engine: Engine, seq: Seq) -> bool:
    """Whether finishing ``seq`` leaves its trajectory open (a session's turn)."""
    session_id = seq.request.session_id
    session = engine.sessions.get(session_id) if session_id is not None else None
    return session is not None and seq.traj is session.traj


def advance_decode_run(
    engine: Engine,
    until: float,
    max_steps: int = MAX_RUN_STEPS,
    *,
    finished: list[RequestOutput] | None = None,
    lookout: RunLookout | None = None,
) -> int:
    """Advance ``engine`` by a uniform decode run ending before ``until`` (clock time);
    returns the steps advanced (0: the next step is not a uniform decode, or a run of fewer
    than two steps would not pay). With ``finished``, the run may end with the step that
    samples some session turns' last tokens; the requests it finishes are appended to it
    (what `Engine.step` returns with ``snapshots=False``). With ``lookout``, it looks at the
    engine inside the run where it asks to (`RunLookout`)."""
    sched, cfg = engine.scheduler, engine.config.scheduler
    running = sched.running
    n = len(running)
    # The cheapest refusals first: about half the calls end at one of these.
    if not n or n > cfg.max_num_batched_tokens:
        return 0
    if sched.waiting and n < cfg.max_num_batched_tokens and n < cfg.max_num_seqs:
        return 0
    # The sequence admitted last is the one most often still prefilling: it alone refuses
    # about a third of the calls that get here, before the loop below walks the others.
    newest = running[-1].traj
    if len(newest.tokens) - newest.num_computed_tokens != 1:
        return 0
    executor, clock, offload, kv = engine.executor, engine.clock, engine.offload, engine.kv
    run_clock = getattr(executor, "decode_run_clock", None)
    if run_clock is None or getattr(clock, "move", None) is None:
        return 0
    if kv.window is not None or offload.busy():  # window tables slide every step: step()
        return 0
    now = clock.now()
    timer = offload.next_event_at()
    if timer is not None:
        if timer <= now:
            return 0
        until = min(until, timer)
    block = kv.block_size
    k_max = max_steps
    max_len = engine.max_model_len
    positions: list[int] = []
    firsts: list[int] = []  # sequence i needs a block at steps firsts[i], firsts[i] + B, ...
    lasts: list[int] = []  # the step sampling sequence i's last token is lasts[i] - 1
    stopping: list[tuple[int, frozenset[int]]] = []  # sequences with stop tokens: theirs
    soonest = k_max + 1  # min(lasts) where it is at most k_max (it alone bounds the run)
    for seq in running:  # hot path
        traj = seq.traj
        p = traj.num_computed_tokens
        tokens = len(traj.tokens)
        if tokens - p != 1 or seq.last_token_time is None:
            return 0
        request = seq.request
        params = request.params
        if request.stop_texts or (params.n > 1 and not request.forked):
            return 0
        # Steps up to and including the one sampling the last token (max_tokens, length).
        # NOTE: conditionals, not min() and max(), on this path: a builtin call costs more.
        last = params.max_tokens - len(seq.output_token_ids)
        if max_len - tokens < last:
            last = max_len - tokens
        if request.stop_ids:  # it may stop early (`stop_rule`: its ids and EOS, unless ignored)
            stopping.append((len(positions), request.stop_ids))
        positions.append(p)
        firsts.append(len(traj.block_table) * block - p)
        lasts.append(last)
        if last < soonest:
            soonest = last
    # The step sampling a last token is left to step() unless the run may finish every
    # sequence whose last token it samples. Only the soonest to end can bound the run:
    # another's last step, or the one before it, is not earlier.
    if soonest <= k_max:
        may_finish = finished is not None
        for i, last in enumerate(lasts):
            if last == soonest and may_finish:
                may_finish = _session_turn(engine, running[i])
        k_max = soonest if may_finish else soonest - 1
    if k_max < 2:
        return 0
    durations, starts = run_clock(positions, now, until, k_max, running)
    k = len(durations)
    # Stay within the blocks free or evictable from the cache (allocating evicts, in the
    # same order as step() would).
    free = kv.free_blocks()
    if n * ((k - 1) // block + 1) > free:  # else even a block per sequence per B steps fits
        while k and _blocks_needed(k, firsts, block) > free:
            k -= 1
    if k < 2:
        return 0
    for i, stop in stopping:  # end before the step that samples a stop token
        seq = running[i]
        a = len(seq.output_token_ids)
        s = executor.decode_run_stream(seq.seed, a, k, lasts[i])  # type: ignore[attr-defined]
        sampled = s.ids[a - s.first : a - s.first + k]
        k = next((j for j, token in enumerate(sampled) if token in stop), k)
    looks: list[int] = []
    if lookout is not None and k >= 2:
        looks, k = lookout.plan_looks(starts if len(starts) == k + 1 else starts[: k + 1])
    if k < 2:
        return 0
    del durations[k:], starts[k + 1 :]
    _apply(engine, (positions, firsts, lasts, durations, starts), finished, looks, lookout)
    return k


# A planned run: per sequence its start position, first block-boundary step and the step
# count to its last token; the steps' durations and start times (``starts[k]``: the end).
# A plain tuple: a NamedTuple's constructor is a Python call, once per run.
_Run = tuple[list[int], list[int], list[int], list[float], list[float]]


def _record_itls(itl: list[float], n: int, gaps: list[float], a: int, b: int, last: int) -> None:
    """Record the inter-token latencies of the run's steps ``a .. b-1``, ``a`` >= 1, of ``n``
    sequences (``gaps[j]``: step ``j``'s; ``last``: how many tokens its final step counts),
    in step order, each step's once per token it counts."""
    k = len(gaps)
    full = b if b < k - 1 else k - 1  # steps a .. full-1 count n tokens each
    if full > a:
        steps = gaps[a:full]
        if n < len(steps):  # fewer slices than steps: interleave n copies of the gaps
            out = [0.0] * (n * len(steps))
            for i in range(n):
                out[i::n] = steps
            itl += out
        else:
            for gap in steps:
                itl += [gap] * n
    if b == k and k - 1 >= a:
        itl += [gaps[k - 1]] * last


def _first_poll(starts: list[float], poll_at: float, lo: int, k: int) -> int:
    """The first step from ``lo`` (``k``: none before the run's end) whose start is at or
    past ``poll_at``, the offload manager's `next_poll_at`: polls before it are no-ops, and
    the margin only adds harmless early ones."""
    if poll_at == math.inf:
        return k
    scale = abs(poll_at)
    return bisect_left(starts, poll_at - 1e-9 * (scale if scale > 1.0 else 1.0), lo, k)


def _computed_at(running: list[Seq], positions: list[int], step: int) -> None:
    """Count each running sequence's KV as computed as of the run's ``step`` (a look's)."""
    for i, seq in enumerate(running):
        seq.traj.computed_in_run(positions[i] + step)


def _apply(
    engine: Engine,
    run: _Run,
    finished: list[RequestOutput] | None,
    looks: list[int],
    lookout: RunLookout | None,
) -> None:
    """Replay ``len(durations)`` decode steps onto the engine, in step order where it matters;
    sequences whose last token the last step samples are finished as `Engine.step` would;
    ``lookout`` looks at the engine at the boundaries ``looks``.

    Only the steps where something happens are visited (a look, an offload poll due, an
    allocation or a commit), in one pass over the sorted events; the clock jumps to each
    look's and poll's step start and to each commit's step end (allocating reads no clock):
    ``starts`` are the sums the clock's own additions would give, so it shows the same times
    as stepping."""
    positions, firsts, lasts, durations, starts = run
    k = len(durations)
    running = list(engine.scheduler.running)
    n = len(running)
    block = engine.kv.block_size
    clock, offload, stats = engine.clock, engine.offload, engine.stats
    commit = engine.config.scheduler.enable_prefix_caching
    # What happens at step j besides the tokens: (j, commit?, sequence), allocations first
    # (before the step executes), commits after.
    events: list[tuple[int, bool, int]] = []
    ending: list[tuple[Seq, int]] = []  # sequences whose last token step k-1 samples: it
    stream = engine.executor.decode_run_stream  # type: ignore[attr-defined]
    itl = stats.itl_s
    first_end = starts[1]  # step 0's inter-token latencies are each sequence's own
    end_time = starts[k]
    for i, seq in enumerate(running):
        traj = seq.traj
        p = positions[i]
        j = firsts[i]
        while j < k:  # not range(): most sequences need no block or one in a run
            events.append((j, False, i))
            j += block
        if commit:
            locked = traj.locked_tokens // block
            first = (locked + 1) * block - p - 1  # the first step whose commit adds
            if first < 0:
                first = 0
            if first < k:
                # Later commits extend one leaf: only the last one shows (its blocks, its
                # access time), at the last step that completes a block.
                last = (p + k) // block * block - p - 1
                if first < last:
                    if not _extends_in_place(traj):
                        events.append((first, True, i))
                    events.append((last, True, i))
                else:
                    events.append((first, True, i))
        itl.append(first_end - seq.last_token_time)  # type: ignore[operator]
        generated = len(seq.output_token_ids)
        drawn = stream(seq.seed, generated, k, lasts[i])
        a = generated - drawn.first
        b = a + k
        if lasts[i] <= k:  # its last token is appended by end_decode_run, which finishes it
            b -= 1
            ending.append((seq, drawn.ids[b]))
        ids = drawn.ids[a:b]
        seq.output_token_ids += ids.tolist()
        # Its tokens and the KV computed at the run's end, at once: the steps below allocate
        # and commit by step, and commit given the count each step's commit would see.
        traj.extend_run(ids, p + k)
        seq.last_token_time = end_time
    assert finished is not None or not ending, "a run finishes sequences only when asked"
    events.sort()
    events.append((k, False, n))  # not an event: the run's end
    # What stepping records as each step's time (`observe_step` adds them up, in order).
    gaps: list[float] = []
    step_time = stats.step_time_s
    before = starts[0]
    for after in starts[1:]:  # hot path: one loop, no map() or reduce() calls per item
        gap = after - before
        gaps.append(gap)
        step_time += gap
        before = after
    move = clock.move  # type: ignore[attr-defined]
    shown = starts[0]  # what the clock shows: nothing but the run may move it
    poll_j = _first_poll(starts, offload.next_poll_at(), 0, k)
    last_count = n - len(ending)  # the last step's tokens (ending sequences' are counted apart)
    recorded = 1  # steps whose inter-token latencies are in itl
    looks.append(k)
    lk = 0  # looks[lk]: the next boundary to look at
    stop_j = looks[0] if looks[0] < poll_j else poll_j  # the next look or poll (k: none)
    # As Engine.step at each step: poll, schedule (allocate), execute, commit. Only the steps
    # of an event, a look or a poll are visited (poll_j: the first step from here whose start
    # is at or past poll_at; it moves only when a poll moves poll_at). Allocating reads no
    # clock: only looks, polls and commits move it.
    for j, is_commit, i in events:
        while stop_j <= j and stop_j < k:  # looks and polls come before the step's events
            move(shown, starts[stop_j])
            shown = starts[stop_j]
            if stop_j == looks[lk]:  # the state after stop_j steps, before polls and allocations
                assert lookout is not None
                _record_itls(itl, n, gaps, recorded, stop_j, last_count)
                recorded = stop_j
                _computed_at(running, positions, stop_j)  # extend_run counted the run's end
                lookout.look()
                lk += 1
            if stop_j == poll_j:
                offload.poll()
                poll_j = _first_poll(starts, offload.next_poll_at(), stop_j + 1, k)
            stop_j = looks[lk] if looks[lk] < poll_j else poll_j
        if j == k:
            break
        if not is_commit:  # the step's tokens cross into a new block: one block more
            running[i].traj.take_block()
            continue
        if shown != starts[j + 1]:  # commits come after the step's execution
            move(shown, starts[j + 1])
            shown = starts[j + 1]
        running[i].traj.commit(positions[i] + j + 1)  # the KV computed after step j
    move(shown, starts[k])
    if lk:  # a look set the KV computed at its step: back to the run's end
        _computed_at(running, positions, k)
    stats.step_time_s = step_time
    # The ending sequences' last tokens are counted by end_decode_run below.
    _record_itls(itl, n, gaps, recorded, k, last_count)
    stats.steps += k
    stats.decode_tokens += n * k
    stats.generated_tokens += n * k - len(ending)
    engine.executor.record_decode_run(running, positions, durations)  # type: ignore[attr-defined]
    if not ending:
        return
    # The last step samples these sequences' last tokens: the engine finishes them.
    for seq, _ in ending:
        seq.last_token_time = starts[k - 1]
    assert finished is not None
    finished += engine.end_decode_run(ending, end_time)
