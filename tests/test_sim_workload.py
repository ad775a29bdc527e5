"""The synthetic agent workload: YAML config, determinism, shared prefixes, heavy tails."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.errors import ConfigError
from kvpilot.sim.distributions import Dist, parse_dist
from kvpilot.sim.drivers import AgentDriver
from kvpilot.sim.trajectories import (
    _MASK64,
    ForkSpec,
    TurnSpec,
    WorkloadGenerator,
    _every_turn,
    _ids,
    _mix64,
)
from kvpilot.sim.workload import DEFAULT_WORKLOAD_YAML, WorkloadConfig


def test_default_yaml_is_the_dataclass_default() -> None:
    assert WorkloadConfig.from_yaml_text(DEFAULT_WORKLOAD_YAML) == WorkloadConfig()
    assert WorkloadConfig.default() == WorkloadConfig()


def test_same_seed_gives_the_same_trajectories_token_for_token() -> None:
    a = WorkloadGenerator(WorkloadConfig(seed=7))
    b = WorkloadGenerator(WorkloadConfig(seed=7))
    for i in (0, 3, 11):
        sa, sb = a.trajectory(i), b.trajectory(i)
        assert sa == sb
        assert a.first_prompt(sa) == b.first_prompt(sb)
        turn = sa.turns[-1]
        assert a.content(turn.content_seed, turn.new_tokens) == b.content(
            turn.content_seed, turn.new_tokens
        )


def test_trajectories_do_not_depend_on_the_order_they_are_asked_for() -> None:
    g = WorkloadGenerator(WorkloadConfig(seed=3))
    forward = [g.trajectory(i) for i in range(5)]
    backward = [g.trajectory(i) for i in reversed(range(5))][::-1]
    assert forward == backward


def test_different_seeds_give_different_workloads() -> None:
    a = WorkloadGenerator(WorkloadConfig(seed=1))
    b = WorkloadGenerator(WorkloadConfig(seed=2))
    assert a.system_ids != b.system_ids
    assert a.trajectory(0) != b.trajectory(0)


def test_shared_prefix_is_identical_ids_and_the_rest_is_not() -> None:
    config = WorkloadConfig(system_tokens=300, tool_tokens=200)
    g = WorkloadGenerator(config)
    p0 = g.first_prompt(g.trajectory(0))
    p1 = g.first_prompt(g.trajectory(1))
    assert p0[:500] == p1[:500] == g.shared_ids
    assert p0[500:520] != p1[500:520]
    assert all(1 <= t < config.vocab_size for t in p0 + p1)


def test_equal_content_seeds_give_equal_ids() -> None:
    g = WorkloadGenerator(WorkloadConfig())
    assert g.content(42, 100) == g.content(42, 100)
    assert g.content(42, 100)[:50] == g.content(42, 50)
    assert g.content(42, 100) != g.content(43, 100)


@pytest.mark.parametrize("vocab", [32000, 2**31, 2**31 + 7, 2**40])
def test_id_arrays_hold_the_same_ids_as_the_lists(vocab: int) -> None:
    """What the drivers send (arrays: int32 when the vocabulary allows, so the engine takes
    them without converting id by id) is the same ids as the lists."""
    g = WorkloadGenerator(WorkloadConfig(seed=5, vocab_size=vocab))
    spec = g.trajectory(2)
    first = g.first_prompt_ids(spec)
    assert first.tolist() == g.first_prompt(spec)
    assert first.typecode == ("i" if vocab <= 2**31 else "q")
    for turn in spec.turns:
        ids = g.content_ids(turn.content_seed, turn.new_tokens)
        assert ids.tolist() == g.content(turn.content_seed, turn.new_tokens)
        assert ids.typecode == first.typecode


def test_volatile_token_position_follows_the_zone() -> None:
    for where, expected in (("head", 0), ("system", 300), ("tools", 500)):
        config = WorkloadConfig(system_tokens=300, tool_tokens=200, volatile_after=where)
        assert WorkloadGenerator(config).volatile_position() == expected
    g = WorkloadGenerator(WorkloadConfig(layout="unstable"))
    assert g.volatile_token(0, 1) != g.volatile_token(0, 2)


def test_observation_lengths_are_heavy_tailed() -> None:
    rng = random.Random(0)
    obs = WorkloadConfig().observation_tokens
    draws = np.array([obs.sample(rng) for _ in range(20000)])
    p50, p99 = np.percentile(draws, [50, 99])
    assert p99 / p50 > 10
    assert draws.mean() > 1.5 * p50


def test_pareto_and_lognormal_tails_match_their_parameters() -> None:
    rng = random.Random(1)
    pareto = Dist("pareto", 100, 2.0)
    draws = np.array([pareto.sample(rng) for _ in range(40000)])
    assert (draws > 1000).mean() == pytest.approx((100 / 1000) ** 2, rel=0.2)
    logn = Dist("lognormal", 50, 1.0)
    assert np.median([logn.sample(rng) for _ in range(20000)]) == pytest.approx(50, rel=0.05)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), index=st.integers(0, 50))
@example(seed=480, index=48)  # a task drawn longer than the budget: cut to fit, not an error
def test_trajectories_fit_their_context_budget(seed: int, index: int) -> None:
    config = WorkloadConfig(seed=seed, max_context_tokens=12000)
    spec = WorkloadGenerator(config).trajectory(index)

    def longest(turns: tuple, used: int) -> int:
        worst = used
        for t in turns:
            used += t.new_tokens + t.output_tokens
            worst = max(worst, used)
            if t.fork is not None:
                worst = max(worst, *(longest(b, used) for b in t.fork.branches))
        return worst

    assert longest(spec.turns, config.shared_tokens) < config.max_context_tokens
    assert spec.turns[0].wait_before_s == 0 and spec.turns[0].tool == ""
    assert all(t.tool in {"bash", "tests", "human"} for t in spec.turns[1:])


def test_branching_probability_one_forks_every_turn_up_to_max_depth() -> None:
    config = WorkloadConfig.from_dict(
        {
            "trajectory": {"turns": 3},
            "branching": {"probability": 1, "fork_factor": 2, "max_depth": 2, "branch_turns": 1},
        }
    )
    spec = WorkloadGenerator(config).trajectory(0)
    assert all(t.fork is not None and len(t.fork.branches) == 2 for t in spec.turns)
    inner = spec.turns[0].fork.branches[0][0]  # type: ignore[union-attr]
    assert inner.fork is not None
    assert inner.fork.branches[0][0].fork is None  # depth 2 reached
    assert spec.num_calls() == 3 + 3 * 2 * (1 + 2)


def test_yaml_sections_override_the_defaults(tmp_path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "seed: 5\n"
        "arrival: {rate_per_s: 0.5, max_open: 10}\n"
        "trajectory: {turns: 4, output_tokens: {dist: pareto, scale: 50, alpha: 1.5, max: 900}}\n"
        "shared_prefix: {system_tokens: 100, tool_tokens: 0, layout: unstable}\n"
        "tools: {review: {weight: 1, wait: {dist: lognormal, median: 120, sigma: 0.5}}}\n"
    )
    config = WorkloadConfig.from_yaml(path)
    assert config.seed == 5
    assert config.arrival.rate_per_s == 0.5 and config.arrival.concurrent is None
    assert config.turns == Dist.fixed(4)
    assert config.output_tokens == Dist("pareto", 50, 1.5, hi=900)
    assert config.layout == "unstable" and config.shared_tokens == 100
    assert [t.name for t in config.tools] == ["review"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour: red", "unknown key"),
        ("arrival: {concurrent: 4, rate_per_s: 1}", "exactly one"),
        ("trajectory: {turns: {dist: zipf, a: 1}}", "unknown dist"),
        ("trajectory: {turns: {dist: uniform, low: 1}}", "missing"),
        ("trajectory: {turns: {dist: lognormal, median: -1, sigma: 1}}", "invalid"),
        ("shared_prefix: {layout: wobbly}", "layout"),
        ("tools: {bash: {weight: 1}}", "needs a wait"),
        ("branching: {probability: 2}", "probability"),
        ("seed: 1.5", "integer"),
        ("[1, 2]", "mapping"),
        ("arrival: [", "not valid YAML"),
    ],
)
def test_bad_workloads_are_rejected_with_the_key_at_fault(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkloadConfig.from_yaml_text(text, "w.yaml")


def test_parse_dist_accepts_numbers_and_clamps() -> None:
    assert parse_dist(3, "x") == Dist.fixed(3)
    d = parse_dist({"dist": "exponential", "mean": 10, "min": 2, "max": 4}, "x")
    rng = random.Random(0)
    assert all(2 <= d.sample(rng) <= 4 for _ in range(200))
    with pytest.raises(ConfigError, match="x"):
        parse_dist(True, "x")


def test_a_shared_prefix_longer_than_the_context_is_an_error() -> None:
    config = WorkloadConfig(system_tokens=5000, tool_tokens=0, max_context_tokens=5001)
    with pytest.raises(ConfigError, match="no room"):
        WorkloadGenerator(config).trajectory(0)


@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3),
    st.integers(0, 40),
    st.sampled_from([16, 32000, 2**31, 2**40]),
)
def test_content_ids_are_splitmix64_of_a_counter(key: list[int], n: int, vocab: int) -> None:
    """The vectorised hash is `_mix64` of ``seed + j`` (mod 2**64), id by id."""
    seed = 0
    for part in key:
        seed = _mix64(((seed ^ part) + 0x9E3779B97F4A7C15) & _MASK64)
    expected = [1 + _mix64((seed + j) & _MASK64) % (vocab - 1) for j in range(n)]
    assert _ids(tuple(key), n, vocab) == expected


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**40), first=st.integers(0, 50), count=st.integers(1, 6))
def test_trajectory_ids_hashed_in_a_batch_are_each_trajectorys_own(
    seed: int, first: int, count: int
) -> None:
    """`trajectory_ids_many` (the driver's batches) gives each trajectory the ids that
    `content` gives its turns, as `trajectory_ids` of it alone does."""
    config = WorkloadConfig.from_dict(
        {
            "seed": seed,
            "trajectory": {"turns": {"dist": "uniform", "low": 1, "high": 6}},
            "branching": {"probability": 0.4, "fork_factor": 2, "max_depth": 1},
        }
    )
    g = WorkloadGenerator(config)
    specs = [g.trajectory(i) for i in range(first, first + count)]
    for spec, ids in zip(specs, g.trajectory_ids_many(specs), strict=True):
        alone = g.trajectory_ids(spec)
        for turn in _every_turn(spec.turns):
            got = ids.turn(turn)
            assert got == alone.turn(turn)
            assert got.tolist() == g.content(turn.content_seed, turn.new_tokens)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**40),
    index=st.integers(0, 30),
    vocab=st.sampled_from([16, 32000, 2**31, 2**31 + 7, 2**40]),
)
def test_trajectory_ids_hash_every_turn_as_content_does(seed: int, index: int, vocab: int) -> None:
    """`trajectory_ids` hashes all of a trajectory's turns (forks' branches included) in one
    pass: each turn's ids are `content`'s for its seed and length, in `content_ids`' array
    type; the first prompt built from them is `first_prompt`'s."""
    config = WorkloadConfig.from_dict(
        {
            "seed": seed,
            "vocab_size": vocab,
            "trajectory": {"turns": {"dist": "uniform", "low": 1, "high": 8}},
            "branching": {"probability": 0.5, "fork_factor": 2, "max_depth": 2},
        }
    )
    g = WorkloadGenerator(config)
    spec = g.trajectory(index)
    ids = g.trajectory_ids(spec)
    assert g.first_prompt_ids(spec, ids).tolist() == g.first_prompt(spec)

    def check(turns: tuple) -> int:
        for turn in turns:
            got = ids.turn(turn)
            assert got.tolist() == g.content(turn.content_seed, turn.new_tokens)
            assert got.typecode == g.content_ids(turn.content_seed, turn.new_tokens).typecode
            if turn.fork is not None:
                for branch in turn.fork.branches:
                    check(branch)
        return len(turns)

    assert check(spec.turns) >= 1


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0, 10) | st.integers(0, 5), min_size=1, max_size=6).filter(
        lambda w: sum(w) > 0
    ),
    seed=st.integers(0, 2**32),
)
def test_tool_draws_are_random_choices_draws(weights: list[float], seed: int) -> None:
    """The generator's tool draw (cumulative weights summed once) is `Random.choices`'s,
    draw for draw, leaving the generator in the same state."""
    config = WorkloadConfig.from_dict(
        {"tools": {f"t{i}": {"weight": w, "wait": 1} for i, w in enumerate(weights)}}
    )
    g = WorkloadGenerator(config)
    ours, theirs = random.Random(seed), random.Random(seed)
    for _ in range(30):
        assert g._tool(ours)[0] == theirs.choices(config.tools, weights=weights)[0].name
    assert ours.random() == theirs.random()


_BOUNDS = st.sampled_from([-math.inf, 0.0, 1.0, 5.0]), st.sampled_from([math.inf, 3.0, 50.0])


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["fixed", "uniform", "lognormal", "pareto", "exponential"]),
    a=st.floats(0.5, 200),
    b=st.floats(0.1, 3),
    lo=_BOUNDS[0],
    hi=_BOUNDS[1],
    minimum=st.integers(0, 4),
    seed=st.integers(0, 2**32),
)
def test_samplers_draw_what_sample_draws(
    kind: str, a: float, b: float, lo: float, hi: float, minimum: int, seed: int
) -> None:
    """`Dist.sampler` / `int_sampler` (the generator's) are `sample` / `sample_int`, draw
    for draw and float for float, clamped or not, leaving the generator in the same state."""
    d = Dist(kind, a, a + b if kind == "uniform" else b, lo=min(lo, hi), hi=hi)
    draw, draw_int = d.sampler(), d.int_sampler(minimum)
    ours, theirs = random.Random(seed), random.Random(seed)
    for i in range(20):
        x, y = draw(ours), d.sample(theirs)
        assert x == y and type(x) is type(y)
        assert draw_int(ours) == d.sample_int(theirs, minimum)
        if i % 3 == 0:  # the lognormal's inlined gauss keeps the pair's second value as gauss
            assert ours.gauss(0.0, 1.0) == theirs.gauss(0.0, 1.0)
    assert ours.random() == theirs.random()
    assert ours.gauss(0.0, 1.0) == theirs.gauss(0.0, 1.0)


def _reference_turns(
    cfg: WorkloadConfig, rng: random.Random, n: int, budget: int, depth: int, first: bool
) -> list[TurnSpec]:
    """`WorkloadGenerator._turns` as plainly as it reads: `Dist.sample_int`, `choices`."""
    out: list[TurnSpec] = []
    br = cfg.branching
    for i in range(n):
        starting = first and i == 0
        new = (cfg.task_tokens if starting else cfg.observation_tokens).sample_int(rng, 1)
        output = cfg.output_tokens.sample_int(rng, 1)
        wait, tool = 0.0, ""
        if not starting:
            spec = rng.choices(cfg.tools, weights=[t.weight for t in cfg.tools])[0]
            wait, tool = max(0.0, spec.wait_s.sample(rng)), spec.name
        seed = rng.getrandbits(63)
        fork = None
        if depth < br.max_depth and br.probability > 0 and rng.random() < br.probability:
            fork = [
                (br.branch_turns.sample_int(rng, 1), rng.getrandbits(63))
                for _ in range(br.fork_factor)
            ]
        if starting and new + output > budget >= 2:
            output = min(output, max(1, budget // 4))
            new = budget - output
        if new + output > budget:
            break
        budget -= new + output
        fork_spec = None
        if fork is not None:
            branches = [
                tuple(_reference_turns(cfg, random.Random(s), k, budget, depth + 1, False))
                for k, s in fork
            ]
            branches = [b for b in branches if b]
            fork_spec = ForkSpec(tuple(branches)) if branches else None
        out.append(TurnSpec(wait, tool, new, output, seed, fork_spec))
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), index=st.integers(0, 200), fork=st.sampled_from([0.0, 0.3]))
def test_trajectories_are_the_plain_draws(seed: int, index: int, fork: float) -> None:
    """The generator's bound samplers draw the trajectory the plain code draws."""
    config = WorkloadConfig.from_dict(
        {
            "seed": seed,
            "trajectory": {"max_context_tokens": 6000},
            "shared_prefix": {"system_tokens": 200, "tool_tokens": 100},
            "branching": {"probability": fork, "fork_factor": 2, "max_depth": 2},
            "tools": {  # waits drawn below zero are none
                "bash": {"weight": 2, "wait": {"dist": "uniform", "low": -2, "high": 3}},
                "tests": {"weight": 1, "wait": {"dist": "lognormal", "median": 20, "sigma": 1}},
            },
        }
    )
    rng = random.Random(f"{seed}:trajectory:{index}")
    n = config.turns.sample_int(rng, minimum=1)
    budget = config.max_context_tokens - config.shared_tokens - 1
    turns = tuple(_reference_turns(config, rng, n, budget, 0, True))
    drawn = WorkloadGenerator(config).trajectory(index).turns
    assert drawn == turns
    assert all(type(t) is TurnSpec for t in _every_turn(drawn))  # made by `_new_turn`


class _RecordingSim:
    """What `AgentDriver` needs of a simulator to begin trajectories: events run in order,
    sessions, and a ``submit`` that records each prompt."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Callable[[], None]]] = []
        self.prompts: list[list[int]] = []
        self.engine = self

    def open_session(self) -> object:
        return object()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.events.append((t, fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.events.append((delay_s, fn))  # the driver binds it; no turn here finishes

    def submit(self, prompt: Sequence[int], max_tokens: int, on_done: object, **kw: object) -> str:
        self.prompts.append(list(prompt))
        return f"r{len(self.prompts)}"


@pytest.mark.parametrize("concurrent", [1, 7, 8, 20])
def test_the_agent_driver_begins_trajectories_in_index_order(concurrent: int) -> None:
    """The driver draws trajectories in batches (`PREPARED`), yet begins trajectory i with
    its own first prompt, in index order."""
    config = WorkloadConfig.from_dict(
        {"seed": 3, "arrival": {"concurrent": concurrent, "ramp_s": 1}}
    )
    driver = AgentDriver(config)
    sim = _RecordingSim()
    driver.start(sim)  # type: ignore[arg-type]
    for _, fn in sim.events:
        fn()
    g = WorkloadGenerator(config)
    assert sim.prompts == [g.first_prompt(g.trajectory(i)) for i in range(concurrent)]
