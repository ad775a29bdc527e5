"""The fleet's front door: kvpilot's router in front of N engine replicas.

The front owns the prefix directory. It pulls each replica's KV events and load every
``poll_interval_s`` through a `ReplicaLink` (Ray Serve deployment handles in production),
tokenizes each request the way the engine will (chat template, tenant salt) to look the
prompt up, routes it, and forwards the HTTP request unchanged to the chosen replica's own
kvpilot app (``{base}/{replica}/v1/...``), streaming the answer back. So the OpenAI API,
sessions, API keys and errors are the single-engine server's, replica for replica.

Faults: a replica that fails a poll or a request is marked down and dropped from the
directory; a request that got no answer from it is routed again (each replica at most
once); a session whose replica is down (or that the router moves off an overloaded one) is
re-created on its new replica and its next turn resends the whole conversation, which the
front mirrors (`kvpilot.fleet.serve.sessions`). A replica that comes back (a new epoch) is
resynced from a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from fastapi import Request

from kvpilot.errors import KvpilotError
from kvpilot.fleet.directory import PrefixDirectory
from kvpilot.fleet.events import ReplicaSnapshot
from kvpilot.fleet.keys import KeySpace
from kvpilot.fleet.kvpilot_router import KvpilotRouter
from kvpilot.fleet.load import FleetView, RouteRequest
from kvpilot.fleet.routers import RouteDecision, make_router
from kvpilot.fleet.scoring import RouterConfig
from kvpilot.fleet.serve.replica import ReplicaHello, ReplicaPoll
from kvpilot.fleet.serve.sessions import FrontSession, FrontSessions
from kvpilot.server.protocol import ApiError
from kvpilot.server.tenancy import ApiKeys

log = logging.getLogger("kvpilot.fleet")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


class ReplicaLink(Protocol):
    """The side channel to one replica (its deployment handle, or an in-process stand-in)."""

    async def hello(self) -> ReplicaHello: ...

    async def poll(self, after_seq: int, epoch: str | None) -> ReplicaPoll: ...

    async def snapshot(self) -> ReplicaSnapshot: ...


class ReplicaDown(KvpilotError):
    """A replica did not answer (it died, or is restarting)."""


@dataclass(frozen=True, slots=True)
class FrontConfig:
    model: str = "tiny"
    router: str = "kvpilot"
    router_config: RouterConfig = field(default_factory=RouterConfig)
    poll_interval_s: float = 0.25
    call_timeout_s: float = 10.0
    request_timeout_s: float = 600.0


class FleetFront:
    def __init__(
        self,
        config: FrontConfig,
        links: dict[str, ReplicaLink],
        http: httpx.AsyncClient,
        tokenizer: Any = None,
        api_keys: ApiKeys | None = None,
        key_space: KeySpace | None = None,
    ) -> None:
        self.config = config
        self.links = links
        self.http = http
        self.tokenizer = tokenizer
        self.api_keys = api_keys or ApiKeys()
        # None: adopted from the first replica that says hello (its block size and model
        # fingerprint), so the router hashes prompts exactly as the engines do.
        self.key_space = key_space
        self.fleet = FleetView(list(links))
        for view in self.fleet.replicas.values():
            view.live = False  # until its first poll answers
        self.directory = PrefixDirectory(key_space.key_space_id if key_space else None)
        if config.router == "kvpilot":
            self.router = make_router(
                "kvpilot",
                self.fleet,
                directory=self.directory,
                config=config.router_config,
                key_space=key_space,
            )
        else:
            self.router = make_router(config.router, self.fleet)
        self.sessions = FrontSessions()
        self.epochs: dict[str, str] = {}
        self.routed = {name: 0 for name in links}
        self.retries = 0
        self._ids = itertools.count()
        self._poller: asyncio.Task[None] | None = None

    # -- replicas: polling, events, faults ----------------------------------------------

    async def start(self) -> None:
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.poll_all()
            except Exception:  # never let one bad poll end the loop
                log.exception("fleet poll failed")

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(name) for name in self.links))

    async def _poll(self, name: str) -> None:
        link = self.links[name]
        sent = time.monotonic()
        directory = self.directory
        try:
            if self.key_space is None:
                hello = await asyncio.wait_for(link.hello(), self.config.call_timeout_s)
                self.adopt_key_space(
                    KeySpace(hello.block_size, bytes.fromhex(hello.model_fingerprint))
                )
            known = name in directory.replicas
            epoch, seq = directory.sync_state(name) if known else (None, 0)
            poll = await asyncio.wait_for(link.poll(seq, epoch), self.config.call_timeout_s)
            if not known:  # only once it answers: a dead replica never reappears in between
                directory.add_replica(name)
            if poll.batch is None or poll.epoch != epoch or not directory.apply(name, poll.batch):
                snapshot = await asyncio.wait_for(link.snapshot(), self.config.call_timeout_s)
                directory.load_snapshot(name, snapshot)
                log.info("replica %s: directory resynced (epoch %s)", name, snapshot.epoch)
        except (TimeoutError, Exception) as exc:
            if isinstance(exc, KvpilotError) and not isinstance(exc, ReplicaDown):
                raise
            self.mark_down(name, exc)
            return
        if self.epochs.get(name, poll.epoch) != poll.epoch:
            self.on_restart(name)
        self.epochs[name] = poll.epoch
        view = self.fleet[name]
        if not view.live:
            log.info("replica %s is up", name)
        view.live = True
        directory.set_live(name, True)
        view.on_report(dataclasses.replace(poll.load, time_s=sent))

    def adopt_key_space(self, space: KeySpace) -> None:
        if self.key_space is not None:
            return
        self.key_space = space
        self.directory.key_space_id = space.key_space_id
        if isinstance(self.router, KvpilotRouter):
            self.router.use_key_space(space)
        log.info("fleet key space: block size %d, model %s", space.block_size, space.model.hex())

    def mark_down(self, name: str, why: object = None) -> None:
        view = self.fleet[name]
        if view.live:
            log.warning("replica %s is down (%s): dropped from the directory", name, why)
        view.live = False
        self.router.on_replica_removed(name)  # kvpilot: forget its blocks

    def on_restart(self, name: str) -> None:
        """The replica came back as a new process: the sessions it held are gone there."""
        lost = self.sessions.on_replica(name)
        for session in lost:
            session.lost = True
        log.warning("replica %s restarted: %d sessions will be rebuilt", name, len(lost))

    # -- routing ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic()

    def tenant(self, request: Request) -> str | None:
        try:
            return self.api_keys.tenant_for(request.headers.get("authorization"))
        except ApiError:
            return None  # the replica answers 401 itself

    def prompt_tokens(self, path: str, body: dict[str, Any], conversation: Any) -> list[int]:
        """The prompt as the engine will tokenize it (empty when that cannot be told)."""
        tok = self.tokenizer
        try:
            if path.endswith("/chat/completions"):
                if tok is None or conversation is None:
                    return []
                messages = [_template_message(m) for m in conversation]
                text = tok.apply_chat_template(
                    messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=False
                )
                return list(tok.encode(text, add_special_tokens=False))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(tok.encode(prompt, add_special_tokens=True)) if tok else []
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except Exception:  # a template that refuses the messages: the replica will say why
            return []
        return []

    def route(self, request: RouteRequest) -> RouteDecision:
        return self.router.route(request, self.now())

    # -- forwarding ---------------------------------------------------------------------

    async def forward(
        self, replica: str, method: str, path: str, headers: dict[str, str], body: bytes | None
    ) -> httpx.Response:
        """Send one request to ``replica`` and return its response, streaming (the caller
        closes it). Raises ReplicaDown when the replica did not answer."""
        url = f"/{replica}{path}"
        request = self.http.build_request(
            method, url, headers=headers, content=body, timeout=self.config.request_timeout_s
        )
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ReplicaDown(f"replica {replica} did not answer: {exc}") from exc
        if response.status_code >= 500 and not await self._alive(replica):
            await response.aclose()
            raise ReplicaDown(f"replica {replica} failed with {response.status_code} and is down")
        return response

    async def _alive(self, replica: str) -> bool:
        try:
            await asyncio.wait_for(
                self.links[replica].hello(), min(5.0, self.config.call_timeout_s)
            )
        except (TimeoutError, Exception):
            return False
        return True

    async def create_remote_session(
        self, replica: str, headers: dict[str, str], salt_in: str | None
    ) -> str:
        body = json.dumps({"cache_salt": salt_in} if salt_in else {}).encode()
        response = await self.forward(replica, "POST", "/v1/sessions", headers, body)
        try:
            data = json.loads(await response.aread())
        finally:
            await response.aclose()
        if response.status_code != 200:
            raise ApiError(response.status_code, str(data.get("error", {}).get("message", data)))
        return str(data["id"])

    async def move_session(
        self, session: FrontSession, target: str, headers: dict[str, str]
    ) -> None:
        """Re-create ``session`` on ``target``; its next turn resends the conversation."""
        old, old_local, lost = session.replica, session.local_id, session.lost
        session.local_id = await self.create_remote_session(target, headers, session.cache_salt)
        session.replica = target
        session.moves += 1
        session.resend = True
        session.lost = False
        if not lost and self.fleet.replicas.get(old) is not None and self.fleet[old].live:
            with contextlib.suppress(Exception):
                response = await self.forward(
                    old, "DELETE", f"/v1/sessions/{old_local}", headers, None
                )
                await response.aclose()
        log.info("session %s moved from %s to %s", session.session_id, old, target)

    def headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if out.get("role") == "developer":
        out["role"] = "system"
    out["content"] = out.get("content") or ""
    return out


def _sse_text(chunk: str, chat: bool) -> str:
    """The generated text carried by the ``data:`` lines of an SSE chunk."""
    out = []
    for line in chunk.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            choice = json.loads(payload)["choices"][0]
            piece = choice["delta"].get("content") if chat else choice.get("text")
            out.append(piece or "")
    return "".join(out)


def _reply_text(data: Any, chat: bool) -> str | None:
    with contextlib.suppress(KeyError, IndexError, TypeError):
        choice = data["choices"][0]
        return str(choice["message"]["content"] or "") if chat else str(choice["text"])
    return None
