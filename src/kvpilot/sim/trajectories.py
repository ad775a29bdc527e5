"""Trajectories of a `WorkloadConfig`: turns, tool waits, forks and their token ids.

Everything random is drawn from per-trajectory generators seeded by ``(seed, index)``, so a
trajectory does not depend on the order the simulator asks for them. Identical content is
identical ids: the shared prefix is one fixed list, and each turn's content is a pure
function of its seed.
"""

from __future__ import annotations

import itertools
import random
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvpilot.errors import ConfigError
from kvpilot.sim.workload import WorkloadConfig


class TurnSpec(NamedTuple):
    """One model call: after a tool wait, ``new_tokens`` of content arrive, ``output_tokens``
    are generated. ``fork`` (if any) runs right after this turn, before the next wait.

    A named tuple, not a frozen dataclass: as immutable, and made ~2.5x cheaper (a frozen
    dataclass sets each field through ``object.__setattr__``); a trajectory makes one per
    turn, with `_new_turn`."""

    wait_before_s: float
    tool: str
    new_tokens: int
    output_tokens: int
    content_seed: int
    fork: ForkSpec | None = None


# ``_new_turn(TurnSpec, fields)`` is ``TurnSpec(*fields)``: a named tuple's ``__new__`` is
# Python code that calls exactly this, ``tuple.__new__(cls, fields)`` (a third of the cost).
_new_turn = tuple.__new__


@dataclass(frozen=True, slots=True)
class ForkSpec:
    branches: tuple[tuple[TurnSpec, ...], ...]


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    index: int
    turns: tuple[TurnSpec, ...]

    def num_calls(self) -> int:
        def count(turns: tuple[TurnSpec, ...]) -> int:
            n = len(turns)
            for t in turns:
                if t.fork is not None:
                    n += sum(count(b) for b in t.fork.branches)
            return n

        return count(self.turns)


class TrajectoryIds:
    """The content ids of one trajectory's turns (`WorkloadGenerator.trajectory_ids`)."""

    __slots__ = ("_at", "_ids")

    def __init__(self, ids: np.ndarray, at: dict[tuple[int, int], int], typecode: str) -> None:
        self._ids = array(typecode)
        self._ids.frombytes(ids.data.cast("B"))  # an array slices into arrays in one call
        self._at = at  # (content seed, tokens) -> where the turn's ids start

    def turn(self, turn: TurnSpec) -> array:
        """``turn``'s content ids: `WorkloadGenerator.content_ids` of its seed and length."""
        n = turn.new_tokens
        start = self._at[turn.content_seed, n]
        return self._ids[start : start + n]


def _every_turn(turns: tuple[TurnSpec, ...]) -> Iterator[TurnSpec]:
    for turn in turns:
        yield turn
        if turn.fork is not None:
            for branch in turn.fork.branches:
                yield from _every_turn(branch)


class WorkloadGenerator:
    """Turns a `WorkloadConfig` into trajectories and their token ids, deterministically."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        # `random.Random.choices(tools, weights)` with its cumulative weights summed once:
        # it draws ``tools[bisect(cum, random() * total, 0, n - 1)]`` (`_tool`).
        self._tool_cum = list(itertools.accumulate(t.weight for t in config.tools))
        self._tool_total = self._tool_cum[-1] + 0.0
        # Each quantity's draw with its distribution bound once (`Dist.sampler`).
        self._draw_task = config.task_tokens.int_sampler(1)
        self._draw_observation = config.observation_tokens.int_sampler(1)
        self._draw_output = config.output_tokens.int_sampler(1)
        self._draw_branch_turns = config.branching.branch_turns.int_sampler(1)
        self._tool_waits = [(t.name, t.wait_s.sampler()) for t in config.tools]
        hi = config.vocab_size
        self.system_ids = _ids((config.seed, 1), config.system_tokens, hi)
        self.tool_ids = _ids((config.seed, 2), config.tool_tokens, hi)
        self._shared = array(_typecode(hi), self.system_ids + self.tool_ids)
        self._content_key = _key_seed((config.seed, 3))  # `content`'s key before the turn's
        self._count = np.arange(0, dtype=np.uint64)  # `_counting`'s, grown as needed

    @property
    def shared_ids(self) -> list[int]:
        return self.system_ids + self.tool_ids

    def volatile_position(self) -> int:
        where = self.config.volatile_after
        if where == "head":
            return 0
        if where == "system":
            return len(self.system_ids)
        return len(self.system_ids) + len(self.tool_ids)

    def content(self, seed: int, n: int) -> list[int]:
        """``n`` token ids of content identified by ``seed`` (same seed, same ids)."""
        return _ids((self.config.seed, 3, seed), n, self.config.vocab_size)

    def content_ids(self, seed: int, n: int) -> array:
        """`content` as an int32 array (int64 for a vocabulary beyond int32): what the engine
        holds, so a prompt of it is not converted id by id (`RequestLimits.prompt_ids`)."""
        return _id_array((self.config.seed, 3, seed), n, self.config.vocab_size)

    def trajectory_ids(self, spec: TrajectorySpec) -> TrajectoryIds:
        """Every turn's `content_ids` of ``spec`` (its forks' branches included), hashed
        together: one set of array operations per trajectory instead of one per turn."""
        return self.trajectory_ids_many([spec])[0]

    def trajectory_ids_many(self, specs: Sequence[TrajectorySpec]) -> list[TrajectoryIds]:
        """`trajectory_ids` of each of ``specs``, hashed in one set of array operations (each
        costs as much as hashing a few thousand ids: a driver that knows which trajectories
        come next hashes them in batches).

        Turn k's ids are the hash of the counter ``seed_k + j`` (j < n_k), ``seed_k`` derived
        from its content seed as `_key_seed` derives it; the turns' counters laid end to end
        are ``arange(total) + repeat(seed_k - start_k, n_k)``, modulo 2**64 as before."""
        ats: list[dict[tuple[int, int], int]] = []
        bounds: list[int] = [0]
        seeds: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        total = 0
        for spec in specs:
            at: dict[tuple[int, int], int] = {}  # within the trajectory's own ids
            begin = total
            for turn in _every_turn(spec.turns):
                key = (turn.content_seed, turn.new_tokens)
                if key not in at:  # equal keys, equal ids: hashed once
                    at[key] = total - begin
                    seeds.append(turn.content_seed & _MASK64)
                    starts.append(total)
                    lengths.append(turn.new_tokens)
                    total += turn.new_tokens
            ats.append(at)
            bounds.append(total)
        bases = np.array(seeds, dtype=np.uint64)
        # `_key_seed((config.seed, 3, seed))`, the last step vectorised over the turns.
        bases ^= np.uint64(self._content_key)
        bases += np.uint64(_GOLDEN)
        _mix_in_place(bases)
        bases -= np.array(starts, dtype=np.uint64)
        x = np.repeat(bases, lengths)
        x += self._counting(total)
        code = _typecode(self.config.vocab_size)
        ids = _counter_ids(x, self.config.vocab_size).astype(_DTYPES[code])
        return [
            TrajectoryIds(ids[a:b], at, code)
            for (a, b), at in zip(itertools.pairwise(bounds), ats, strict=True)
        ]

    def _counting(self, n: int) -> np.ndarray:
        """``np.arange(n, dtype=np.uint64)``, read-only: a view of one array kept and grown
        by doubling (arange computes every item anew, a pass that costs as much as a mix step)."""
        if len(self._count) < n:
            self._count = np.arange(max(n, 2 * len(self._count)), dtype=np.uint64)
            self._count.flags.writeable = False
        return self._count[:n]

    def volatile_token(self, traj_index: int, call_index: int) -> int:
        rng = random.Random(f"{self.config.seed}:volatile:{traj_index}:{call_index}")
        return rng.randrange(1, self.config.vocab_size)

    def first_prompt(self, spec: TrajectorySpec) -> list[int]:
        """``system + tools + task`` (the volatile token is the caller's, if unstable)."""
        first = spec.turns[0]
        return self.shared_ids + self.content(first.content_seed, first.new_tokens)

    def first_prompt_ids(self, spec: TrajectorySpec, ids: TrajectoryIds | None = None) -> array:
        """`first_prompt` as an array (`content_ids`; the task's from ``ids`` if given)."""
        first = spec.turns[0]
        if ids is not None:
            return self._shared + ids.turn(first)
        return self._shared + self.content_ids(first.content_seed, first.new_tokens)

    def trajectory(self, index: int) -> TrajectorySpec:
        cfg = self.config
        rng = random.Random(f"{cfg.seed}:trajectory:{index}")
        budget = cfg.max_context_tokens - cfg.shared_tokens - 1
        n_turns = cfg.turns.sample_int(rng, minimum=1)
        turns = self._turns(rng, n_turns, budget, depth=0, first=True)
        if not turns:
            raise ConfigError(
                f"workload {cfg.name!r}: the shared prefix ({cfg.shared_tokens} tokens) leaves "
                f"no room for a turn within max_context_tokens={cfg.max_context_tokens}"
            )
        return TrajectorySpec(index, tuple(turns))

    def _tool(self, rng: random.Random) -> tuple[str, Callable[[random.Random], float]]:
        """``rng.choices(tools, weights)[0]``: the same draw, the same tool (its name and
        wait's sampler)."""
        cum = self._tool_cum
        return self._tool_waits[bisect_right(cum, rng.random() * self._tool_total, 0, len(cum) - 1)]

    def _turns(
        self, rng: random.Random, n: int, budget: int, depth: int, first: bool
    ) -> list[TurnSpec]:
        """Up to ``n`` turns within ``budget`` tokens. The draws per turn, in this order:
        new tokens, output tokens, tool and its wait (not before the first turn), content
        seed, and, while ``depth`` allows forks, whether to fork (then each branch's turns
        and seed)."""
        br = self.config.branching
        draw_output = self._draw_output
        may_fork = depth < br.max_depth and br.probability > 0
        out: list[TurnSpec] = []
        for i in range(n):
            starting = first and i == 0
            if starting:
                new = self._draw_task(rng)
                output = draw_output(rng)
                wait, tool = 0.0, ""
            else:
                new = self._draw_observation(rng)
                output = draw_output(rng)
                tool, draw_wait = self._tool(rng)
                wait = draw_wait(rng)
                wait = wait if wait > 0.0 else 0.0  # max(0.0, wait), without the builtin's cost
            seed = rng.getrandbits(63)
            fork = None
            if may_fork and rng.random() < br.probability:
                fork = [
                    (self._draw_branch_turns(rng), rng.getrandbits(63))
                    for _ in range(br.fork_factor)
                ]
            if starting and new + output > budget >= 2:
                # A task drawn longer than the context allows is cut to fit: every
                # trajectory starts with one (the draws, and so the other turns, unchanged).
                output = min(output, max(1, budget // 4))
                new = budget - output
            if new + output > budget:
                break
            budget -= new + output
            fork_spec = None
            if fork is not None:
                branches = []
                for count, branch_seed in fork:
                    sub = random.Random(branch_seed)
                    turns = self._turns(sub, count, budget, depth + 1, first=False)
                    if turns:
                        branches.append(tuple(turns))
                fork_spec = ForkSpec(tuple(branches)) if branches else None
            out.append(_new_turn(TurnSpec, (wait, tool, new, output, seed, fork_spec)))
        return out


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit hash of a 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _key_seed(key: tuple[int, ...]) -> int:
    """The counter's start for ``key``: each part mixed into the last."""
    seed = 0
    for part in key:
        seed = _mix64(((seed ^ (part & _MASK64)) + _GOLDEN) & _MASK64)
    return seed


def _ids(key: tuple[int, ...], n: int, vocab_size: int) -> list[int]:
    """``n`` token ids in [1, vocab_size) that are a pure function of ``key``."""
    return _hashed_ids(key, n, vocab_size).tolist()


def _typecode(vocab_size: int) -> str:
    return "i" if vocab_size <= 1 << 31 else "q"


def _id_array(key: tuple[int, ...], n: int, vocab_size: int) -> array:
    """`_ids` as an array (int32 when the vocabulary allows), copied from numpy's buffer."""
    code = _typecode(vocab_size)
    out = array(code)
    out.frombytes(_hashed_ids(key, n, vocab_size).astype(_DTYPES[code]).data.cast("B"))
    return out


def _hashed_ids(key: tuple[int, ...], n: int, vocab_size: int) -> np.ndarray:
    """The ids of `_ids`: a counter hashed by splitmix64 (one vectorised pass; a seeded
    generator costs far more per call than the ids it draws)."""
    x = np.arange(n, dtype=np.uint64)
    x += np.uint64(_key_seed(key))  # array arithmetic wraps modulo 2**64, as the hash wants
    return _counter_ids(x, vocab_size)


def _counter_ids(x: np.ndarray, vocab_size: int) -> np.ndarray:
    """``1 + _mix64(c) % (vocab_size - 1)`` of every counter ``c`` in ``x`` (uint64, changed
    in place and returned)."""
    _mix_in_place(x)
    # x % m as x - (x // m) * m: the same remainder, but numpy divides uint64 by a scalar
    # with a multiply (libdivide) and takes the remainder with a hardware divide, ~5x slower.
    m = np.uint64(vocab_size - 1)
    q = x // m
    q *= m
    x -= q
    x += _ONE
    return x


def _mix_in_place(x: np.ndarray) -> None:
    """`_mix64` of every item of ``x`` (uint64; arithmetic wraps modulo 2**64)."""
    shifted = np.empty_like(x)  # one scratch array for the three shifts
    for shift, mul in _MIX_STEPS:
        np.right_shift(x, shift, out=shifted)
        x ^= shifted
        if mul is not None:
            x *= mul


# `_mix64` as array operations: x ^= x >> 30; x *= M1; x ^= x >> 27; x *= M2; x ^= x >> 31.
_MIX_STEPS = (
    (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9)),
    (np.uint64(27), np.uint64(0x94D049BB133111EB)),
    (np.uint64(31), None),
)
_ONE = np.uint64(1)
_DTYPES = {"i": np.int32, "q": np.int64}
