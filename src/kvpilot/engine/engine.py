"""The engine users hold: `EngineCore` (the step loop and the request lifecycle) with loading
from a checkpoint, batch generation, outputs by id, the session API and the read models."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from kvpilot.engine.clock import Clock
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.core import EngineCore
from kvpilot.engine.outputs import as_prompt_list
from kvpilot.engine.request import RequestOutput, encode_prompt
from kvpilot.engine.sampling import SamplingParams
from kvpilot.engine.session import Session
from kvpilot.engine.snapshot import EngineSnapshot, LoadGauges, load_gauges, take_snapshot
from kvpilot.errors import InvalidRequest
from kvpilot.policy.breakeven import PauseDecision


class Engine(EngineCore):
    """Continuous-batching engine over the paged KV memory core."""

    @classmethod
    def from_pretrained(
        cls, model: str | Path = "tiny", *, clock: Clock | None = None, **options: Any
    ) -> Engine:
        """Load a checkpoint folder (or the built-in ``tiny``) and build an engine on it.

        ``options`` are flat `EngineConfig` names (`FLAT_OPTIONS`, e.g. ``kv_blocks=64``,
        ``host_memory_bytes=...``, ``pause_policy="drop"``) and ``cache_dir``; or pass a whole
        ``config=EngineConfig(...)``. See `kvpilot.model.build.build_engine`.
        """
        from kvpilot.model.build import build_engine

        cache_dir = options.pop("cache_dir", None)
        load_progress = options.pop("load_progress", None)  # a model.loader.LoadProgress
        config = options.pop("config", None) or EngineConfig()
        return build_engine(
            model,
            config.replace(**options),
            clock=clock,
            cache_dir=cache_dir,
            load_progress=load_progress,
        )

    # -- requests and outputs ---------------------------------------------------------

    def encode(self, prompt: str | Seq[int], *, add_special_tokens: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, add_special_tokens=add_special_tokens)

    def get_output(self, request_id: str) -> RequestOutput:
        if request_id in self._finished_outputs:
            return self._finished_outputs[request_id]
        request = self.requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"unknown request {request_id!r}")
        return self._snapshot(request)

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

    # -- sessions (the table does the work) -------------------------------------------

    def open_session(self, salt: str | None = None, session_id: str | None = None) -> Session:
        return self.sessions.open(salt, session_id)

    def get_session(self, session_id: str) -> Session:
        return self.sessions.require(session_id)

    def pause_session(
        self, session: Session, expected_wait_s: float | None = None, tool: str | None = None
    ) -> PauseDecision:
        """The agent went off to a tool: decide what to do with this session's KV."""
        return self.sessions.pause(session, expected_wait_s, tool)

    def fork_session(self, session: Session, n: int = 1) -> list[Session]:
        return self.sessions.fork(session, n)

    def close_session(self, session: Session) -> None:
        self.sessions.close(session)

    def close(self) -> None:
        """Stop background copiers and close the disk tier (idempotent)."""
        self.offload.close()
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    # -- read models and checks -------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """Counters, gauges and tiers now (engine thread): what /metrics, /health and the
        simulator read."""
        parts = (self.config, self.kv, self.scheduler, self.stats, self.offload)
        return take_snapshot(self.clock.now(), *parts, open_sessions=len(self.sessions))

    def load_gauges(self) -> LoadGauges:
        """The snapshot's usage and queue gauges alone, for frequent sampling."""
        return load_gauges(self.kv, self.scheduler)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.sessions.check_invariants()
        self.offload.check_invariants(self.sessions)
        self.scheduler.check_invariants()
