"""The engine: requests in, a step loop over the scheduler and an executor, outputs out.

The engine owns no model code and never reads wall time (it asks its `Clock`), so the
simulator drives this same loop with a simulated executor on virtual time.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.engine.clock import Clock, WallClock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.executor import Executor, TierTransport
from kvpilot.engine.offload import OffloadManager
from kvpilot.engine.outputs import as_prompt_list, decode, find_stop, seq_text, snapshot
from kvpilot.engine.request import (
    Request,
    RequestOutput,
    SeqStatus,
    Sequence,
)
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.engine.session import Session
from kvpilot.engine.stats import EngineStats
from kvpilot.errors import InvalidRequest, OutOfBlocks, PromptTooLong
from kvpilot.memory import KVConfig, KVManager, Tier
from kvpilot.policy.breakeven import PauseDecision
from kvpilot.policy.pause import make_pause_policy


class Engine:
    """Continuous-batching engine over the paged KV memory core."""

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
    ) -> None:
        self.config = config or EngineConfig()
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock: Clock = clock or WallClock()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        limits = [x for x in (self.config.max_model_len, max_model_len) if x]
        self.max_model_len = min(limits) if limits else 1 << 30
        self.vocab_size = vocab_size
        host_blocks = transport.num_host_blocks if transport is not None else 0
        self.kv = KVManager(
            KVConfig(
                block_size=executor.block_size,
                num_device_blocks=executor.num_blocks,
                num_host_blocks=host_blocks,
                model_fingerprint=executor.fingerprint.digest,
            ),
            clock=self.clock.now,
        )
        if self.config.poison_freed_blocks:
            self._poison_freed_blocks(executor, transport)
        self.scheduler = Scheduler(self.config, self.kv, reclaim_idle=self._reclaim_idle)
        self.scheduler.admission_gate = self._admission_gate
        self.scheduler.on_admit = self._on_admit
        self.offload = self._make_offload(transport)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self.sessions: dict[str, Session] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._session_ids = itertools.count()
        self._rng = random.Random(self.config.seed)
        self._finished_outputs: dict[str, RequestOutput] = {}

    # -- construction -----------------------------------------------------------------

    def _poison_freed_blocks(self, executor: Executor, transport: TierTransport | None) -> None:
        """Every block a pool frees is overwritten with NaN by whoever holds its KV."""
        self.kv.device.on_free = executor.poison_blocks
        host = self.kv.pools.get(Tier.HOST)
        if host is not None and transport is not None:
            host.on_free = transport.poison_host

    def _make_offload(self, transport: TierTransport | None) -> OffloadManager:
        cfg = self.config
        disk = sessions = None
        if cfg.disk_dir is not None and transport is not None:
            from kvpilot.store import DiskBlockStore, SessionStore

            model = self.executor.fingerprint
            disk = DiskBlockStore(
                Path(cfg.disk_dir), cfg.disk_kv_blocks, transport.block_bytes, model=model
            )
            sessions = SessionStore(Path(cfg.disk_dir), model=model)
        return OffloadManager(
            self.kv,
            make_pause_policy(cfg.pause_policy, ttl_s=cfg.pause_ttl_s),
            self.clock.now,
            transport=transport,
            disk=disk,
            session_store=sessions,
            default_wait_s=cfg.default_tool_wait_s,
            prefetch=cfg.prefetch,
            pressure=self._memory_pressure,
        )

    def _memory_pressure(self) -> float:
        """Shadow price of device memory: 1 while work waits, else usage against tau_high."""
        if any(s.prefix_reused for s in self.scheduler.waiting):
            return 1.0
        return min(1.0, self.scheduler.held_usage() / self.config.tau_high)

    @classmethod
    def from_pretrained(
        cls, model: str | Path = "tiny", *, clock: Clock | None = None, **options: Any
    ) -> Engine:
        """Load a checkpoint folder (or the built-in ``tiny``) and build an engine on it."""
        from kvpilot.model import ModelRunner

        cache_dir = options.pop("cache_dir", None)
        load_progress = options.pop("load_progress", None)  # a model.loader.LoadProgress
        config = EngineConfig.from_kwargs(**options)
        runner = ModelRunner(
            model,
            num_blocks=config.kv_blocks,
            kv_memory_bytes=None if config.kv_blocks is not None else config.kv_memory_bytes,
            block_size=config.block_size,
            dtype=config.dtype,
            device=config.device,
            attention=config.attention,
            gpu_memory_utilization=config.gpu_memory_utilization,
            cuda_graphs=config.cuda_graphs,
            cache_dir=cache_dir,
            progress=load_progress,
        )
        transport = None
        if config.has_tiers:
            from kvpilot.model.transfer import TorchTierTransport

            host_blocks = config.host_kv_blocks or (
                (config.host_memory_bytes or 0) // runner.kv_bytes_per_block
            )
            transport = TorchTierTransport(runner.kv_cache, host_blocks)
        return cls(
            runner,
            config,
            tokenizer=runner.tokenizer,
            eos_token_ids=runner.eos_token_ids,
            max_model_len=runner.max_model_len,
            vocab_size=runner.config.vocab_size,
            clock=clock,
            transport=transport,
        )

    # -- requests ---------------------------------------------------------------------

    def encode(self, prompt: str | Seq[int], *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: send token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        try:
            arr = np.asarray(prompt)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"a prompt is a string or a list of token ids: {exc}") from exc
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidRequest(
                "a prompt is a string or a flat list of integer token ids "
                f"(got {arr.dtype.name} values{' nested' if arr.ndim > 1 else ''})"
            )
        return arr.tolist()

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
            session._check_open()
            if session.active_request is not None:
                raise InvalidRequest(
                    f"session {session.session_id} is running turn {session.active_request}"
                )
            if params.n != 1:
                raise InvalidRequest("n > 1 is not allowed on a session turn: fork the session")
            salt = session.salt
        first_turn = session is None or not session.traj.tokens
        tokens = self.encode(prompt, add_special_tokens=first_turn)
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        self.validate_tokens(tokens)
        history = len(session.traj.tokens) if session is not None else 0
        self.check_fits(history + len(tokens), history)
        rid = request_id or f"req-{next(self._request_ids)}"
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        request = Request(
            request_id=rid,
            prompt_token_ids=tokens,
            params=params,
            arrival_time=self.clock.now(),
            seed=seed,
            session_id=session.session_id if session else None,
            salt=salt,
            history_tokens=history,
        )
        if expected_tool_wait_s is not None or tool is not None:
            if session is None:
                raise InvalidRequest("expected_tool_wait_s and tool need a session")
            if expected_tool_wait_s is not None and not 0 <= expected_tool_wait_s < math.inf:
                raise InvalidRequest(
                    "expected_tool_wait_s must be a finite, non-negative number of seconds"
                )
            request.pause_hint = (expected_tool_wait_s, tool)
        if session is not None:
            if self.offload.record_for(session.session_id) is not None:
                request.resumed = True
                self.offload.on_resume(session)
            traj = session.traj
            traj.append_tokens(tokens)
            session.active_request = rid
            session.turns += 1
        else:
            traj = self.kv.open_trajectory(salt=salt, tokens=tokens)
        seq = Sequence(next(self._seq_ids), request, traj, index=0, seed=seed)
        request.seqs.append(seq)
        self.requests[rid] = request
        self.scheduler.add(seq)
        return rid

    def check_fits(self, total: int, history: int = 0) -> None:
        """PromptTooLong unless a context of ``total`` tokens leaves room to generate."""
        if total >= self.max_model_len:
            raise PromptTooLong(
                f"prompt of {total} tokens (history {history} + new {total - history}) leaves "
                f"no room to generate within the model context of {self.max_model_len} tokens"
            )
        capacity = self.kv.device.num_blocks * self.kv.block_size
        if total + 1 > capacity:
            raise PromptTooLong(
                f"prompt of {total} tokens exceeds the KV pool of {capacity} tokens "
                f"({self.kv.device.num_blocks} blocks of {self.kv.block_size}): give the "
                "engine more KV memory"
            )

    def validate_tokens(self, tokens: list[int]) -> None:
        """InvalidRequest unless every token id is in the model's vocabulary."""
        limit = self.vocab_size
        low, high = min(tokens), max(tokens)
        if low < 0 or (limit is not None and high >= limit):
            bad = [t for t in tokens if t < 0 or (limit is not None and t >= limit)]
            raise InvalidRequest(
                f"token id(s) {bad[:5]} out of range [0, {limit}) for this model's vocabulary"
            )

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
        return self.scheduler.has_work()

    # -- the step loop ----------------------------------------------------------------

    def step(self, *, snapshots: bool = True) -> list[RequestOutput]:
        """Run one scheduled batch; returns a snapshot of every request that progressed
        (with ``snapshots=False``, only of those that finished: the simulator's fast path)."""
        self.offload.poll(self._idle_sessions)
        sched = self.scheduler.schedule()
        for seq in sched.starved:
            # Alone in the pool and still no block to grow into: end it rather than spin.
            self._finish_seq(seq, "length")
            self._finish_request_if_done(seq.request)
        if not sched.scheduled:
            if self.offload.busy():
                self.clock.sleep(0.0005)  # only waiting on copies: let them run
            return [self._snapshot(s.request) for s in sched.starved]
        start = self.clock.now()
        result = self.executor.execute(sched.works)
        now = self.clock.now()
        self.stats.steps += 1
        self.stats.step_time_s += now - start
        self.stats.prefill_tokens += sched.num_prefill_tokens
        self.stats.decode_tokens += sched.num_decode_tokens
        if sched.num_prefill_tokens:
            context = max(w.start_pos + len(w.token_ids) for w in sched.works)
            self.offload.observe_step(sched.num_prefill_tokens, now - start, context)
        return self._process(sched, result.tokens, now, snapshots)

    def _process(
        self,
        sched: SchedulerOutput,
        sampled: dict[int, list[int]],
        now: float,
        snapshots: bool = True,
    ) -> list[RequestOutput]:
        block = self.kv.block_size
        progressed: dict[str, Request] = {}
        for item in sched.scheduled:
            seq = item.seq
            traj = seq.traj
            traj.mark_computed(item.num_tokens)
            high = self.offload.high_water
            if high.get(traj.traj_id, 0) < traj.num_computed_tokens:
                high[traj.traj_id] = traj.num_computed_tokens
            if (
                self.config.enable_prefix_caching
                and traj.num_computed_tokens // block > traj.locked_tokens // block
            ):
                traj.commit()
            if not item.sample:
                continue
            tokens = sampled[seq.seq_id]
            request = seq.request
            progressed[request.request_id] = request
            if len(tokens) > 1:
                self._fan_out(seq, tokens, now)
            else:
                self._append_token(seq, tokens[0], now)
        for request in progressed.values():
            self._finish_request_if_done(request)
        if not snapshots:
            done = self._finished_outputs
            return [done[rid] for rid in progressed if rid in done]
        return [self._snapshot(r) for r in progressed.values()]

    def _fan_out(self, parent: Sequence, tokens: list[int], now: float) -> None:
        """n > 1: the prompt was prefilled once; fork it so each branch decodes on its own."""
        request = parent.request
        request.forked = True
        copies: list[tuple[int, int]] = []
        children: list[Sequence] = []
        # Speculative branches are gated first under pressure: past tau_high they wait in
        # the queue (recomputing only their tail from the cache) instead of running now.
        gated = self.scheduler.held_usage() >= self.config.tau_high
        for index in range(1, len(tokens)):
            child_traj, copy = None, None
            if not gated:
                try:
                    fork = parent.traj.fork()
                    child_traj, copy = fork.child, fork.copy
                except OutOfBlocks:
                    pass  # no block for the partial tail
            if child_traj is None:
                # Deferred: the branch waits in the queue and recomputes its tail from the cache.
                parent.traj.commit()
                child_traj = self.kv.open_trajectory(request.salt, parent.traj.tokens)
                self.stats.gated_forks += 1
            if copy is not None:
                copies.append(copy)
            child = Sequence(
                next(self._seq_ids), request, child_traj, index=index, seed=request.seed + index
            )
            child.prefix_reused = child_traj.num_computed_tokens > 0
            request.seqs.append(child)
            children.append(child)
            self.stats.forks += 1
        if copies:
            self.executor.copy_blocks(copies)
            self.stats.fork_copied_blocks += len(copies)
        for child in children:
            if child.traj.num_computed_tokens:
                child.status = SeqStatus.RUNNING
                self.scheduler.running.append(child)
            else:
                self.scheduler.add(child)
        self._append_token(parent, tokens[0], now)
        for child, token in zip(children, tokens[1:], strict=True):
            self._append_token(child, token, now)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.traj.append_token(token)
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.stats.ttft_s.append(now - seq.request.arrival_time)
                if seq.request.resumed:
                    self.offload.stats.resume_ttft_s.append(now - seq.request.arrival_time)
        else:
            self.stats.itl_s.append(now - (seq.last_token_time or now))
        seq.last_token_time = now
        self.stats.generated_tokens += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.scheduler.remove(seq)
            self._finish_seq(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.params
        if token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos
        ):
            return "stop"
        if params.stop and self.tokenizer is not None:
            text = self._decode(seq.output_token_ids)
            window = len(seq.output_text) - max(len(s) for s in params.stop)
            cut = find_stop(text, params.stop, max(0, window))
            seq.output_text = text if cut is None else text[:cut]
            if cut is not None:
                seq.detok_offset = -1  # text is final
                return "stop"
        if len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        if len(seq.traj.tokens) >= self.max_model_len:
            return "length"
        return None

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock.now()
        request = seq.request
        session = self.sessions.get(request.session_id) if request.session_id else None
        if session is not None and seq.traj is session.traj:
            seq.traj.finish_turn()
        else:
            if not self.config.enable_prefix_caching:
                seq.traj.release_kv(keep_in_cache=False)
            seq.traj.close()
            self.offload.high_water.pop(seq.traj.traj_id, None)

    def _finish_request_if_done(self, request: Request) -> None:
        if not request.finished or request.request_id in self._finished_outputs:
            return
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += request.history_tokens + len(request.prompt_token_ids)
        self.stats.cached_tokens += request.cached_tokens
        self.stats.e2e_s.append(self.clock.now() - request.arrival_time)
        output = self._snapshot(request)
        self._finished_outputs[request.request_id] = output
        if request.session_id is not None:
            session = self.sessions.get(request.session_id)
            if session is not None:
                session.active_request = None
                session.last_used = self.clock.now()
                session.last_output = output
                if request.pause_hint is not None and not request.aborted:
                    self.pause_session(session, *request.pause_hint)
        del self.requests[request.request_id]

    # -- outputs ----------------------------------------------------------------------

    def _decode(self, token_ids: Seq[int]) -> str:
        return decode(self.tokenizer, token_ids)

    def _text(self, seq: Sequence) -> str:
        return seq_text(self.tokenizer, seq)

    def _snapshot(self, request: Request) -> RequestOutput:
        done = self._finished_outputs.get(request.request_id)
        return done if done is not None else snapshot(request, self.tokenizer)

    def get_output(self, request_id: str) -> RequestOutput:
        if request_id in self._finished_outputs:
            return self._finished_outputs[request_id]
        request = self.requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"unknown request {request_id!r}")
        return self._snapshot(request)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The finished output of a request, forgotten afterwards."""
        return self._finished_outputs.pop(request_id)

    def run_until_finished(self, request_id: str) -> RequestOutput:
        while request_id not in self._finished_outputs:
            if not self.has_unfinished():
                raise InvalidRequest(f"request {request_id!r} is not running")
            self.step()
        return self.pop_output(request_id)

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion; outputs in the order given."""
        batch = as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(batch)
        else:
            plist = list(params)
            if len(plist) != len(batch):
                raise InvalidRequest("give one SamplingParams, or one per prompt")
        ids = [self.add_request(p, sp, salt=salt) for p, sp in zip(batch, plist, strict=True)]
        while any(rid not in self._finished_outputs for rid in ids):
            self.step()
        return [self.pop_output(rid) for rid in ids]

    # -- sessions ---------------------------------------------------------------------

    def open_session(self, salt: str | None = None, session_id: str | None = None) -> Session:
        sid = session_id or f"sess-{next(self._session_ids)}"
        if sid in self.sessions:
            raise InvalidRequest(f"session id {sid!r} is already in use")
        stored = self.offload.session_store.load(sid) if self.offload.session_store else None
        if stored is not None:
            # A session paused before a restart: its tokens come back from SQLite, its KV
            # from the disk tier (whatever is still there and verifies) on the next turn.
            traj = self.kv.open_trajectory(salt=stored.salt, tokens=stored.tokens)
            self.offload.restored(traj)
            salt = stored.salt
        else:
            traj = self.kv.open_trajectory(salt=salt)
        session = Session(self, sid, traj, salt)
        self.sessions[sid] = session
        return session

    def pause_session(
        self, session: Session, expected_wait_s: float | None = None, tool: str | None = None
    ) -> PauseDecision:
        """The agent went off to a tool: decide what to do with this session's KV."""
        return self.offload.pause(session, expected_wait_s, tool)

    def get_session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"unknown session {session_id!r}")
        return session

    def fork_session(self, session: Session, n: int = 1) -> list[Session]:
        session._check_open()
        if session.active_request is not None:
            raise InvalidRequest("cannot fork a session while a turn is running")
        if n < 1:
            raise InvalidRequest("fork needs n >= 1")
        forks: list[Session] = []
        copies: list[tuple[int, int]] = []
        for _ in range(n):
            try:
                result = session.traj.fork()
                traj = result.child
                if result.copy is not None:
                    copies.append(result.copy)
            except OutOfBlocks:
                session.traj.commit()
                traj = self.kv.open_trajectory(session.salt, session.traj.tokens)
            sid = f"{session.session_id}.{next(self._session_ids)}"
            child = Session(self, sid, traj, session.salt)
            child.turns = session.turns
            self.sessions[sid] = child
            forks.append(child)
        if copies:
            self.executor.copy_blocks(copies)
            self.stats.fork_copied_blocks += len(copies)
        self.stats.forks += n
        return forks

    def close_session(self, session: Session) -> None:
        if session.closed:
            return
        if session.active_request is not None:
            self.abort(session.active_request)
        self.offload.forget(session)
        session.traj.close()
        session.closed = True
        self.sessions.pop(session.session_id, None)

    def _idle_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.idle and s.traj.block_table]

    def _reclaim_idle(self, blocks_wanted: int) -> int:
        """Memory pressure: idle sessions' KV gives way (demoted by the offload manager)."""
        del blocks_wanted  # one session at a time; the scheduler asks again if short
        return self.offload.reclaim(self._idle_sessions())

    def _admission_gate(self, seq: Sequence) -> bool:
        """Ready when the prefix is device-resident; short of room to load it, idle
        sessions give way, then (with nothing running) other waiting work does."""
        while True:
            if self.offload.ensure_resident(seq.traj):
                return True
            if not self.offload.mover.short_of_memory:
                return False  # its load is in flight
            if self._reclaim_idle(0):
                continue
            if not self.scheduler.running and self.scheduler.release_waiting(seq):
                continue
            return False

    def _on_admit(self, seq: Sequence) -> None:
        traj = seq.traj
        high = self.offload.high_water.get(traj.traj_id, 0)
        lost = min(high, len(traj.tokens) - 1) - traj.num_computed_tokens
        if lost > 0:
            self.offload.stats.recomputed_tokens += lost
        if seq.index == 0 and not seq.output_token_ids and seq.num_preemptions == 0:
            loaded = self.offload.take_loaded(traj)
            request = seq.request
            host = min(loaded["host"], request.cached_tokens)
            disk = min(loaded["disk"], request.cached_tokens - host)
            request.cached_by_tier = {
                "device": request.cached_tokens - host - disk,
                "host": host,
                "disk": disk,
            }

    def close(self) -> None:
        """Stop background copiers and close the disk tier (idempotent)."""
        self.offload.close()
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    # -- checks -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        for seq in self.scheduler.running:
            assert seq.status is SeqStatus.RUNNING, f"seq {seq.seq_id} in running is {seq.status}"
            assert seq.traj.num_computed_tokens <= len(seq.traj.tokens)
        for seq in self.scheduler.waiting:
            assert seq.status is SeqStatus.WAITING
        assert len(set(map(id, self.scheduler.running))) == len(self.scheduler.running)
