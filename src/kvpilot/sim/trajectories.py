"""Trajectories of a `WorkloadConfig`: turns, tool waits, forks and their token ids.

Everything random is drawn from per-trajectory generators seeded by ``(seed, index)``, so a
trajectory does not depend on the order the simulator asks for them. Identical content is
identical ids: the shared prefix is one fixed list, and each turn's content is a pure
function of its seed.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

import numpy as np

from kvpilot.errors import ConfigError
from kvpilot.sim.workload import WorkloadConfig


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One model call: after a tool wait, ``new_tokens`` of content arrive, ``output_tokens``
    are generated. ``fork`` (if any) runs right after this turn, before the next wait."""

    wait_before_s: float
    tool: str
    new_tokens: int
    output_tokens: int
    content_seed: int
    fork: ForkSpec | None = None


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


class WorkloadGenerator:
    """Turns a `WorkloadConfig` into trajectories and their token ids, deterministically."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._weights = [t.weight for t in config.tools]
        hi = config.vocab_size
        self.system_ids = _ids((config.seed, 1), config.system_tokens, hi)
        self.tool_ids = _ids((config.seed, 2), config.tool_tokens, hi)
        self._shared = array(_typecode(hi), self.system_ids + self.tool_ids)

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

    def volatile_token(self, traj_index: int, call_index: int) -> int:
        rng = random.Random(f"{self.config.seed}:volatile:{traj_index}:{call_index}")
        return rng.randrange(1, self.config.vocab_size)

    def first_prompt(self, spec: TrajectorySpec) -> list[int]:
        """``system + tools + task`` (the volatile token is the caller's, if unstable)."""
        first = spec.turns[0]
        return self.shared_ids + self.content(first.content_seed, first.new_tokens)

    def first_prompt_ids(self, spec: TrajectorySpec) -> array:
        """`first_prompt` as an array (`content_ids`)."""
        first = spec.turns[0]
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

    def _turns(
        self, rng: random.Random, n: int, budget: int, depth: int, first: bool
    ) -> list[TurnSpec]:
        cfg = self.config
        out: list[TurnSpec] = []
        for i in range(n):
            starting = first and i == 0
            new = (cfg.task_tokens if starting else cfg.observation_tokens).sample_int(rng, 1)
            output = cfg.output_tokens.sample_int(rng, 1)
            if starting:
                wait, tool = 0.0, ""
            else:
                spec = rng.choices(cfg.tools, weights=self._weights)[0]
                wait, tool = max(0.0, spec.wait_s.sample(rng)), spec.name
            seed = rng.getrandbits(63)
            fork = None
            br = cfg.branching
            if depth < br.max_depth and br.probability > 0 and rng.random() < br.probability:
                fork = [
                    (br.branch_turns.sample_int(rng, 1), rng.getrandbits(63))
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
            out.append(TurnSpec(wait, tool, new, output, seed, fork_spec))
        return out


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit hash of a 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _ids(key: tuple[int, ...], n: int, vocab_size: int) -> list[int]:
    """``n`` token ids in [1, vocab_size) that are a pure function of ``key``."""
    return _hashed_ids(key, n, vocab_size).tolist()


def _typecode(vocab_size: int) -> str:
    return "i" if vocab_size <= 1 << 31 else "q"


def _id_array(key: tuple[int, ...], n: int, vocab_size: int) -> array:
    """`_ids` as an array (int32 when the vocabulary allows), copied from numpy's buffer."""
    code = _typecode(vocab_size)
    x = _hashed_ids(key, n, vocab_size).astype(np.int32 if code == "i" else np.int64)
    out = array(code)
    out.frombytes(x.tobytes())
    return out


def _hashed_ids(key: tuple[int, ...], n: int, vocab_size: int) -> np.ndarray:
    """The ids of `_ids`: a counter hashed by splitmix64 (one vectorised pass; a seeded
    generator costs far more per call than the ids it draws, and a simulation draws a turn's
    content at every call)."""
    seed = 0
    for part in key:
        seed = _mix64(((seed ^ (part & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64)
    x = np.arange(n, dtype=np.uint64)
    x += np.uint64(seed)  # array arithmetic wraps modulo 2**64, as the hash wants
    shifted = np.empty_like(x)  # one scratch array for the three shifts
    for shift, mul in _MIX_STEPS:
        np.right_shift(x, shift, out=shifted)
        x ^= shifted
        if mul is not None:
            x *= mul
    x %= np.uint64(vocab_size - 1)
    x += _ONE
    return x


# `_mix64` as array operations: x ^= x >> 30; x *= M1; x ^= x >> 27; x *= M2; x ^= x >> 31.
_MIX_STEPS = (
    (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9)),
    (np.uint64(27), np.uint64(0x94D049BB133111EB)),
    (np.uint64(31), None),
)
_ONE = np.uint64(1)
