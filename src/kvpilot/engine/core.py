"""The engine's core: requests in, a step loop over the scheduler and an executor, outputs out.

The engine owns no model code and never reads wall time (it asks its `Clock`), so the
simulator drives this same loop with a simulated executor on virtual time. Sessions live in
a `SessionTable`, pauses and tiers in the `OffloadManager`, admission in the `Scheduler`:
this module is the step loop and the request lifecycle around it (`EngineCore`);
`kvpilot.engine.engine.Engine` adds loading, batch generation, sessions and read models.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from kvpilot.engine.admission import admission_hooks
from kvpilot.engine.branches import fork_branches
from kvpilot.engine.clock import Clock, WallClock
from kvpilot.engine.config import EngineConfig, check_honoured
from kvpilot.engine.executor import Executor, TierTransport, WindowExecutor, window_kv_options
from kvpilot.engine.idle_skip import IdleSkipper
from kvpilot.engine.offload import OffloadManager
from kvpilot.engine.outputs import snapshot, stop_reason, stop_rule
from kvpilot.engine.request import (
    FINISHED,
    PromptIds,
    Request,
    RequestLimits,
    RequestOutput,
    Sequence,
    pause_hint,
)
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.engine.session import Session, SessionTable
from kvpilot.engine.stats import EngineStats
from kvpilot.errors import InvalidRequest
from kvpilot.memory import KVConfig, KVManager, Tier

if TYPE_CHECKING:
    from kvpilot.store import DiskBlockStore, SessionStore


class EngineCore:
    """The step loop and the request lifecycle around it (`Engine` adds the rest)."""

    def __init__(
        self,
        executor: Executor,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        clock: Clock | None = None,
        transport: TierTransport | None = None,
        disk: DiskBlockStore | None = None,
        session_store: SessionStore | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock: Clock = clock or WallClock()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        check_honoured(config.runner, executor, transport, disk)
        limits = [x for x in (config.max_model_len, max_model_len) if x]
        self.max_model_len = min(limits) if limits else 1 << 30
        self.vocab_size = vocab_size
        self.limits = RequestLimits(
            self.max_model_len, vocab_size, executor.num_blocks, executor.block_size
        )
        host_blocks = transport.num_host_blocks if transport is not None else 0
        self.kv = KVManager(
            KVConfig(
                block_size=executor.block_size,
                num_device_blocks=executor.num_blocks,
                num_host_blocks=host_blocks,
                model_fingerprint=executor.fingerprint.digest,
                **window_kv_options(executor),
            ),
            clock=self.clock.now,
        )
        if config.runner.poison_freed_blocks:
            self._poison_freed_blocks(executor, transport)
        self.stats = EngineStats()
        self.offload = OffloadManager(
            self.kv,
            config.pause,
            self.clock.now,
            transport=transport,
            disk=disk,
            session_store=session_store,
            pressure=lambda: self.scheduler.memory_pressure(),
        )
        self.sessions = SessionTable(
            self.kv, self.offload, executor, self.clock.now, self.stats, runner=self
        )
        hooks, _ = admission_hooks(
            self.kv,
            self.offload,
            self.sessions,
            self.clock.now,
            config.scheduler.max_defer_s,
            config.scheduler,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, hooks)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._rng = random.Random(self.config.seed)
        self._finished_outputs: dict[str, RequestOutput] = {}
        self._idle_skipper = IdleSkipper(self)

    # -- construction -----------------------------------------------------------------

    def _poison_freed_blocks(self, executor: Executor, transport: TierTransport | None) -> None:
        """Every block a pool frees is overwritten with NaN by whoever holds its KV."""
        self.kv.device.on_free = executor.poison_blocks
        if self.kv.window is not None and isinstance(executor, WindowExecutor):
            self.kv.window.set_on_free(executor.poison_window_blocks)
        host = self.kv.pools.get(Tier.HOST)
        if host is not None and transport is not None:
            host.on_free = transport.poison_host

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session: Session | None = None,
        salt: str | None = None,
        expected_tool_wait_s: float | None = None,
        tool: str | None = None,
    ) -> str:
        """Queue a request (or a session's next turn); returns its id."""
        params = params or SamplingParams()
        if session is not None:
            self.sessions.check_turn(session, params)
            salt = session.salt
        history = len(session.traj.tokens) if session is not None else 0
        ids = self.limits.prompt_ids(  # int32: what the trajectory and the request hold
            self.tokenizer, prompt, history, add_special_tokens=history == 0
        )
        rid = request_id or f"req-{next(self._request_ids)}"
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        hint = None
        if expected_tool_wait_s is not None or tool is not None:
            hint = pause_hint(expected_tool_wait_s, tool, on_session=session is not None)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        stop_ids, stop_texts = stop_rule(params, self.eos_token_ids, self.tokenizer)
        request = Request(  # positional: `Request` lists these fields first, in this order
            rid,
            PromptIds(ids),
            params,
            self.clock.now(),
            seed,
            session.session_id if session is not None else None,
            salt,
            history,
            hint,
            stop_ids,
            stop_texts,
        )
        if session is not None:
            traj = self.sessions.begin_turn(session, request, ids)
        else:
            traj = self.kv.open_trajectory(salt=salt)
            traj.append_tokens(ids)
        seq = Sequence(next(self._seq_ids), request, traj, 0, seed)  # branch 0 (positional)
        request.seqs.append(seq)
        self.requests[rid] = request
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"unknown request {request_id!r}")
        request.aborted = True
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._finish_seq(seq, "abort")
        self._finish_request_if_done(request)

    def has_unfinished(self) -> bool:
        sched = self.scheduler  # `Scheduler.has_work`, without a second call (every loop)
        return bool(sched.waiting or sched.running)

    # -- the step loop ----------------------------------------------------------------

    def step(
        self, *, snapshots: bool = True, idle_until: float | None = None
    ) -> list[RequestOutput]:
        """Run one scheduled batch; returns a snapshot of every request that progressed
        (with ``snapshots=False``, only of those that finished: the simulator's fast path).
        ``idle_until``: the caller's next event (clock time), which lets an idle step on
        virtual time skip ahead to the next copy completion before it (`IdleSkipper`)."""
        self.offload.poll()
        sched = self.scheduler.schedule()
        for seq in sched.starved:
            # Alone in the pool and still no block to grow into: end it rather than spin.
            self._finish_seq(seq, "length")
            self._finish_request_if_done(seq.request)
        if not sched.seqs:
            if self.offload.busy() or self.scheduler.held_back:
                self._idle_skipper.idle_step(idle_until)
            return [self._snapshot(s.request) for s in sched.starved]
        start = self.clock.now()
        result = self.executor.execute(sched.works)
        now = self.clock.now()
        self.stats.observe_step(now - start, sched.num_prefill_tokens, sched.num_decode_tokens)
        if sched.num_prefill_tokens:
            self.offload.observe_step(sched.num_prefill_tokens, now - start, sched.context)
        return self._process(sched, result.tokens, now, snapshots)

    def _process(
        self, sched: SchedulerOutput, sampled: dict[int, list[int]], now: float, snapshots: bool
    ) -> list[RequestOutput]:
        block = self.kv.block_size
        caching = self.config.scheduler.enable_prefix_caching
        append_token = self._append_token
        # Requests that sampled this step, first seen first (only snapshots need them all).
        progressed: dict[str, Request] | None = {} if snapshots else None
        # Requests one of whose sequences finished this step, in step order: only those can
        # have finished (a finished request's sampled sequences all finished in this step,
        # so its first finishing sequence is its first sampled one: the order of
        # `progressed`). Usually none.
        ended: list[Request] = []
        # Hot path: every running sequence, every step. One work per sequence (the scheduler
        # appends both together): zip's strict= would be a keyword call per step.
        for seq, work in zip(sched.seqs, sched.works):  # noqa: B905
            traj = seq.traj
            traj.mark_computed(len(work.token_ids))
            if caching and traj.num_computed_tokens // block > traj.locked_tokens // block:
                traj.commit()
            if work.sampling is None:
                continue
            tokens = sampled[seq.seq_id]
            if progressed is not None:
                progressed[seq.request.request_id] = seq.request
            if len(tokens) > 1:
                self._fan_out(seq, tokens, now)
                ended.append(seq.request)  # branches: checked as before, rare
            elif append_token(seq, tokens[0], now):
                ended.append(seq.request)
        if progressed is not None:
            for request in dict.fromkeys(ended):  # each once, in step order
                self._finish_request_if_done(request)
            return [self._snapshot(r) for r in progressed.values()]
        # A request scheduled this step was unfinished before it (a finished one is filed
        # and never scheduled again): only those that finished now are filed. Most steps
        # finish none.
        return self._finish(dict.fromkeys(ended)) if ended else []

    def end_decode_run(self, last: list[tuple[Sequence, int]], now: float) -> list[RequestOutput]:
        """A decode run's last step sampled these sequences' last tokens at ``now``: append
        and finish them as `_process` does; returns the outputs of the requests it finished
        (`kvpilot.engine.decode_run`)."""
        requests: list[Request] = []  # in order, each once (a run ends few sequences)
        for seq, token in last:
            self._append_token(seq, token, now)
            if seq.request not in requests:
                requests.append(seq.request)
        return self._finish(requests)

    def _finish(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Finish each of ``requests`` whose sequences are all done; their outputs."""
        done = self._finished_outputs
        outputs: list[RequestOutput] = []
        for request in requests:
            self._finish_request_if_done(request)
            output = done.get(request.request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fan_out(self, parent: Sequence, tokens: list[int], now: float) -> None:
        """n > 1: the prompt was prefilled once; fork it so each branch decodes on its own."""
        children = fork_branches(
            parent,
            len(tokens) - 1,
            self.kv,
            self.scheduler,
            self.executor,
            self.stats,
            gated=self.scheduler.held_usage() >= self.config.scheduler.tau_high,
            seq_ids=self._seq_ids,
        )
        self._append_token(parent, tokens[0], now)
        for child, token in zip(children, tokens[1:], strict=True):
            self._append_token(child, token, now)

    def _append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a sampled token and count it; returns whether it finished the sequence.

        Hot path (every token a step samples): `stop_reason` runs only when one of its
        tests can stop the sequence (most tokens stop nothing); the test below is its tests'
        first conditions (a stop token, stop strings, either length)."""
        traj = seq.traj
        traj.append_token(token)
        out = seq.output_token_ids
        out.append(token)
        request = seq.request
        last = seq.last_token_time  # set with the first token (`observe_first_token`)
        if last is None:
            if seq.index == 0 and request.resumed:
                self.offload.observe_resume_ttft(now - request.arrival_time)
            self.stats.observe_first_token(seq, now)
        else:  # a later token: its inter-token latency, inline (every token a step samples)
            stats = self.stats
            stats.itl_s.append(now - last)
            stats.generated_tokens += 1
            seq.last_token_time = now
        if (
            token not in request.stop_ids
            and not request.stop_texts
            and len(out) < request.params.max_tokens
            and len(traj.tokens) < self.max_model_len
        ):
            return False
        reason = stop_reason(seq, token, self.tokenizer, self.max_model_len)
        if reason is None:
            return False
        self.scheduler.remove(seq)
        self._finish_seq(seq, reason)
        return True

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.status = FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock.now()
        request = seq.request
        session = self.sessions.get(request.session_id) if request.session_id else None
        if session is not None and seq.traj is session.traj:
            seq.traj.finish_turn()
        else:
            if not self.config.scheduler.enable_prefix_caching:
                seq.traj.release_kv(keep_in_cache=False)
            seq.traj.close()

    def _finish_request_if_done(self, request: Request) -> None:
        if not request.finished or request.request_id in self._finished_outputs:
            return
        self.stats.observe_finished(request, self.clock.now())
        output = snapshot(request, self.tokenizer, True)  # not filed yet (checked above)
        self._finished_outputs[request.request_id] = output
        if request.session_id is not None:
            self.sessions.end_turn(request)
        del self.requests[request.request_id]
        request.release()

    # -- outputs ----------------------------------------------------------------------

    def _snapshot(self, request: Request) -> RequestOutput:
        done = self._finished_outputs.get(request.request_id)
        return done if done is not None else snapshot(request, self.tokenizer)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The finished output of a request, forgotten afterwards."""
        return self._finished_outputs.pop(request_id)

    def run_until_finished(self, request_id: str) -> RequestOutput:
        while request_id not in self._finished_outputs:
            if not self.has_unfinished():
                raise InvalidRequest(f"request {request_id!r} is not running")
            self.step()
        return self.pop_output(request_id)
