"""Shared equivalence checks: a run that made some cache decision against a recompute.

"Tokens are the truth": whatever the engine does with KV (share a prefix, fork, move it to
host or disk and back, drop it), every turn's output must equal a recompute of the same
turn from its tokens alone. A recompute here is a fresh engine without prefix caching, fed
each turn's whole context as one prompt. Both tokens and logits are compared (fp32: max abs
difference <= 1e-4), on context-sensitive models (tests/test_sensitivity.py).

The scenarios below are used twice: by the tests that must pass, and by
tests/test_sabotage.py, which runs them under a deliberate bug and expects
`EquivalenceMismatch` (so every check here is shown to be able to fail).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine import Engine, SamplingParams, Session, VirtualClock
from kvpilot.engine.executor import SeqWork, StepOutput
from kvpilot.engine.snapshot import EngineSnapshot
from kvpilot.model.parallel.executor import TensorParallelExecutor
from kvpilot.model.runner import ModelRunner

LOGITS_ATOL = 1e-4
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
FIRST = [(7 * i + 3) % 240 + 5 for i in range(150)]
SECOND = [(11 * i + 1) % 240 + 5 for i in range(20)]
THIRD = [(13 * i + 2) % 240 + 5 for i in range(9)]


class EquivalenceMismatch(AssertionError):
    """A run's output differs from the recompute of the same turn."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn's generated tokens and the fp32 logits each was sampled from."""

    tokens: tuple[int, ...]
    logits: torch.Tensor  # [len(tokens), vocab]


def assert_same_turns(got: Sequence[Turn], want: Sequence[Turn], atol: float = LOGITS_ATOL) -> None:
    """Raise `EquivalenceMismatch` at the first step whose logits or token differ."""
    if len(got) != len(want):
        raise EquivalenceMismatch(f"{len(got)} turns, the recompute has {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if len(g.tokens) != len(w.tokens):
            raise EquivalenceMismatch(f"turn {i}: {len(g.tokens)} tokens vs {len(w.tokens)}")
        for k in range(len(w.tokens)):
            diff = float((g.logits[k] - w.logits[k]).abs().max())
            if not diff <= atol:  # NaN fails too
                raise EquivalenceMismatch(
                    f"turn {i}, token {k}: logits differ by {diff:.3g} (> {atol:g}) from a "
                    f"recompute; tokens {list(g.tokens)} vs {list(w.tokens)}"
                )
            if g.tokens[k] != w.tokens[k]:
                raise EquivalenceMismatch(
                    f"turn {i}, token {k}: {list(g.tokens)} vs {list(w.tokens)} recomputed"
                )


class LogitRecorder:
    """Keeps the fp32 logits every sampled token of ``engine`` came from, per sequence.

    Wraps the runner's ``execute`` (which sequences sample this step, in order) and
    ``model.logits`` (the rows they are sampled from, in the same order).
    """

    def __init__(self, engine: Engine) -> None:
        runner = engine.executor
        if isinstance(runner, TensorParallelExecutor):
            model = runner.shard.model  # rank 0 holds the gathered logits
        else:
            assert isinstance(runner, ModelRunner), "logits need a ModelRunner"
            model = runner.model
        self.engine = engine
        self.rows: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
        self._sampling: list[int] = []
        execute, logits = runner.execute, model.logits

        def recording_execute(works: Sequence[SeqWork]) -> StepOutput:
            self._sampling = [w.seq_id for w in works if w.sampling is not None]
            try:
                return execute(works)
            finally:
                self._sampling = []

        def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = logits(hidden)
            if self._sampling:
                assert out.shape[0] == len(self._sampling)
                for seq_id, row in zip(self._sampling, out, strict=True):
                    self.rows[seq_id].append(row.detach().float().cpu().clone())
            return out

        runner.execute = recording_execute  # type: ignore[method-assign]
        model.logits = recording_logits  # type: ignore[method-assign]

    def finish(self, request_id: str) -> Turn:
        """Run the request to the end; its tokens and logits."""
        seq_id = self.engine.requests[request_id].seqs[0].seq_id
        return self._turn(seq_id, self.engine.run_until_finished(request_id).token_ids)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams = PARAMS
    ) -> list[Turn]:
        """Run a batch of requests together, checking invariants after every step."""
        engine = self.engine
        ids = [engine.add_request(list(p), params) for p in prompts]
        seqs = [engine.requests[rid].seqs[0].seq_id for rid in ids]
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
        outs = [engine.pop_output(rid) for rid in ids]
        return [self._turn(s, out.token_ids) for s, out in zip(seqs, outs, strict=True)]

    def _turn(self, seq_id: int, token_ids: Sequence[int]) -> Turn:
        rows = self.rows.pop(seq_id, [])
        tokens = tuple(token_ids)
        assert len(rows) == len(tokens), f"{len(rows)} logit rows for {len(tokens)} tokens"
        return Turn(tokens, torch.stack(rows))

    def turn(self, session: Session, prompt: Sequence[int], **hint: Any) -> Turn:
        return self.finish(session.submit(list(prompt), PARAMS, **hint))


# -- the recompute ---------------------------------------------------------------------


def reference_turns(model: str | Path, prompts: Sequence[Sequence[int]]) -> list[Turn]:
    """Each turn of a session with these prompts, recomputed from its whole context."""
    return list(_reference(str(model), tuple(tuple(p) for p in prompts)))


@functools.cache
def _reference(model: str, prompts: tuple[tuple[int, ...], ...]) -> tuple[Turn, ...]:
    engine = Engine.from_pretrained(model, kv_blocks=128, enable_prefix_caching=False)
    recorder = LogitRecorder(engine)
    history: list[int] = []
    turns = []
    for prompt in prompts:
        history += prompt
        turn = recorder.finish(engine.add_request(list(history), PARAMS))
        history += turn.tokens
        turns.append(turn)
    engine.close()
    return tuple(turns)


# -- scenarios -------------------------------------------------------------------------


def tiered(model: str | Path, tmp: Path, policy: str, **kw: object) -> Engine:
    """An engine with a host tier and a disk tier in ``tmp``, on virtual time."""
    options: dict[str, object] = {
        "kv_blocks": 128,
        "host_kv_blocks": 128,
        "disk_dir": str(disk_dir(tmp, policy)),
        "disk_kv_blocks": 256,  # a small data file: the damage tests rewrite it whole
        "pause_policy": policy,
    }
    options.update(kw)
    return Engine.from_pretrained(str(model), clock=VirtualClock(), **options)


def disk_dir(tmp: Path, policy: str) -> Path:
    return tmp / f"disk-{policy}"


def settle(engine: Engine) -> None:
    """Let background copies finish (the step loop polls them)."""
    while engine.offload.busy():
        engine.step()
        engine.check_invariants()


def turns_with_pauses(
    engine: Engine, prompts: Sequence[Sequence[int]] = (FIRST, SECOND, THIRD), wait_s: float = 30.0
) -> list[Turn]:
    """A session whose every turn ends on a tool call: the policy moves its KV each time."""
    recorder = LogitRecorder(engine)
    session = engine.open_session()
    turns = []
    for prompt in prompts:
        turns.append(recorder.turn(session, prompt))
        engine.check_invariants()
        session.pause(expected_wait_s=wait_s, tool="pytest")
        settle(engine)
    session.close()
    return turns


def corrupt(disk: Path, how: str) -> None:
    """Damage the disk tier's data file: flip a high byte every 4 KiB, cut it, or delete it."""
    data = disk / "blocks.dat"
    if how == "flip":
        raw = bytearray(data.read_bytes())
        for i in range(3, len(raw), 4096):
            raw[i] ^= 0xFF  # byte 3 of a little-endian float: its sign and exponent
        data.write_bytes(bytes(raw))
    elif how == "truncate":
        with data.open("r+b") as f:
            f.truncate(min(os.path.getsize(data), 100_000))  # cuts inside the second block
    else:
        data.unlink()


def turns_around_disk_damage(engine: Engine, disk: Path, how: str) -> list[Turn]:
    """Turn one, offload to disk, damage the disk tier, turn two: [FIRST, SECOND]."""
    recorder = LogitRecorder(engine)
    session = engine.open_session()
    first = recorder.turn(session, FIRST)
    session.pause(expected_wait_s=30.0)
    settle(engine)
    corrupt(disk, how)
    second = recorder.turn(session, SECOND)
    return [first, second]


def forked_turns(engine: Engine) -> list[Turn]:
    """A session forks with a partial tail block (copy-on-write); parent and child go on
    with different prompts: [parent's SECOND turn, child's THIRD turn]."""
    recorder = LogitRecorder(engine)
    session = engine.open_session()
    recorder.turn(session, FIRST)  # 158 tokens: the tail block holds 14
    (child,) = session.fork(1)
    return [recorder.turn(session, SECOND), recorder.turn(child, THIRD)]


def forked_references(model: str | Path) -> list[Turn]:
    return [reference_turns(model, [FIRST, SECOND])[1], reference_turns(model, [FIRST, THIRD])[1]]


PREEMPT_PROMPTS = [[(5 * i + 17 * k) % 240 + 5 for i in range(34 + 9 * k)] for k in range(6)]
PREEMPT_PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def preemption_run(
    model: str | Path, kv_blocks: int = 16, host_kv_blocks: int = 128, **options: Any
) -> tuple[list[Turn], EngineSnapshot]:
    """Six prompts at once in a device pool too small for all of them (with a host tier
    unless ``host_kv_blocks=0``): running sequences are preempted. Each prompt's turn, and
    the engine's counters at the end."""
    if host_kv_blocks:
        options["host_kv_blocks"] = host_kv_blocks
    engine = Engine.from_pretrained(
        str(model), kv_blocks=kv_blocks, clock=VirtualClock(), **options
    )
    turns = LogitRecorder(engine).generate(PREEMPT_PROMPTS, PREEMPT_PARAMS)
    snap = engine.snapshot()
    engine.close()
    return turns, snap


def preempted_swap_turns(model: str | Path, **options: Any) -> list[Turn]:
    """`preemption_run` where the break-even rule chooses the copy: preempted sequences are
    swapped to host, then loaded back on readmission."""
    turns, snap = preemption_run(model, **options)
    assert snap.preemptions_swapped > 0, "the scenario must swap a preempted sequence"
    return turns


def preempted_references(model: str | Path) -> list[Turn]:
    return [_solo(str(model), tuple(p), PREEMPT_PARAMS) for p in PREEMPT_PROMPTS]


@functools.cache
def _solo(model: str, prompt: tuple[int, ...], params: SamplingParams) -> Turn:
    engine = Engine.from_pretrained(model, kv_blocks=128, enable_prefix_caching=False)
    (turn,) = LogitRecorder(engine).generate([list(prompt)], params)
    engine.close()
    return turn


SHARED_A = FIRST[:64]
SHARED_B = FIRST[:40] + SECOND  # shares two whole blocks and half of the third with A


def shared_prefix_turns(engine: Engine) -> list[Turn]:
    """A then B, B reusing A's cached blocks as far as their tokens agree: [A, B]."""
    recorder = LogitRecorder(engine)
    return [recorder.finish(engine.add_request(p, PARAMS)) for p in (SHARED_A, SHARED_B)]


def shared_prefix_references(model: str | Path) -> list[Turn]:
    return [reference_turns(model, [SHARED_A])[0], reference_turns(model, [SHARED_B])[0]]
