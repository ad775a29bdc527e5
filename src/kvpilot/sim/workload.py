"""Synthetic agent workloads: trajectories of turns separated by tool waits, sometimes forking.

A workload is a YAML file (every key optional; `DEFAULT_WORKLOAD_YAML` is the built-in
default). Quantities are numbers or distributions (see `kvpilot.sim.distributions`)::

    name: default-agent
    seed: 0                        # same seed, same trajectories, token for token
    vocab_size: 32000              # synthetic token ids are drawn from [1, vocab_size)
    arrival:
      concurrent: 128              # closed loop: keep this many trajectories open ...
      ramp_s: 60                   #   ... the first ones starting spread over ramp_s
      # rate_per_s: 0.05           # or open loop: Poisson arrivals at this rate
      # max_open: 512              #   (optional cap on open trajectories; arrivals beyond wait)
    trajectory:
      turns: {dist: uniform, low: 6, high: 30}            # model calls per trajectory
      task_tokens: {dist: lognormal, median: 800, sigma: 0.6, max: 8000}
      observation_tokens: {dist: lognormal, median: 400, sigma: 1.3, max: 30000}
      output_tokens: {dist: lognormal, median: 150, sigma: 0.7, min: 8, max: 2000}
      max_context_tokens: 120000   # a trajectory ends before its context would pass this
    shared_prefix:
      system_tokens: 2000          # the same system prompt (same ids) in every trajectory
      tool_tokens: 3000            # the same tool definitions, after the system prompt
      layout: stable               # stable | unstable
      volatile_after: head         # unstable: where the per-call volatile token sits:
                                   #   head | system | tools (after that zone)
    tools:                         # tool called after each turn, drawn by weight
      bash:   {weight: 0.6,  wait: {dist: lognormal, median: 2, sigma: 0.8}}
      tests:  {weight: 0.35, wait: {dist: lognormal, median: 30, sigma: 0.6}}
      human:  {weight: 0.05, wait: {dist: lognormal, median: 180, sigma: 0.7}}
    pause_hints: median            # what a turn tells the engine about the tool call after it:
                                   #   median (tool + its median wait), exact (the actual wait),
                                   #   tool (name only: the engine predicts), none (no pause)
    branching:
      probability: 0.05            # chance a turn forks its trajectory (while depth allows)
      fork_factor: 3               # branches per fork (session.fork(n))
      max_depth: 1                 # forks within forks up to this depth
      branch_turns: {dist: uniform, low: 1, high: 3}

A trajectory's first prompt is ``system + tools + task``; each later turn appends one tool
observation to the session (stable layout). With an unstable layout every call re-sends its
whole context with a fresh volatile token (a timestamp, a request id) at ``volatile_after``:
everything after it misses the prefix cache. A fork runs its branches (each a few turns
after its own tool wait) while the parent waits; the parent then resumes.

`kvpilot.sim.trajectories.WorkloadGenerator` turns a config into trajectories and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpilot.errors import ConfigError
from kvpilot.sim.distributions import Dist, parse_dist

LAYOUTS = ("stable", "unstable")
PAUSE_HINTS = ("median", "exact", "tool", "none")
VOLATILE_ZONES = ("head", "system", "tools")

DEFAULT_WORKLOAD_YAML = """\
name: default-agent
seed: 0
vocab_size: 32000
arrival:
  concurrent: 128
  ramp_s: 60
trajectory:
  turns: {dist: uniform, low: 6, high: 30}
  task_tokens: {dist: lognormal, median: 800, sigma: 0.6, max: 8000}
  observation_tokens: {dist: lognormal, median: 400, sigma: 1.3, max: 30000}
  output_tokens: {dist: lognormal, median: 150, sigma: 0.7, min: 8, max: 2000}
  max_context_tokens: 120000
shared_prefix:
  system_tokens: 2000
  tool_tokens: 3000
  layout: stable
  volatile_after: head
tools:
  bash: {weight: 0.6, wait: {dist: lognormal, median: 2, sigma: 0.8}}
  tests: {weight: 0.35, wait: {dist: lognormal, median: 30, sigma: 0.6}}
  human: {weight: 0.05, wait: {dist: lognormal, median: 180, sigma: 0.7}}
pause_hints: median
branching:
  probability: 0.05
  fork_factor: 3
  max_depth: 1
  branch_turns: {dist: uniform, low: 1, high: 3}
"""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    weight: float
    wait_s: Dist


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    """Closed loop (``concurrent`` open trajectories) or open loop (Poisson ``rate_per_s``)."""

    concurrent: int | None = 128
    rate_per_s: float | None = None
    ramp_s: float = 60.0
    max_open: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrent is None) == (self.rate_per_s is None):
            raise ConfigError("arrival: give exactly one of concurrent or rate_per_s")
        if self.concurrent is not None and self.concurrent < 1:
            raise ConfigError(f"arrival.concurrent must be >= 1, got {self.concurrent}")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ConfigError(f"arrival.rate_per_s must be positive, got {self.rate_per_s}")
        if self.ramp_s < 0:
            raise ConfigError("arrival.ramp_s must not be negative")
        if self.max_open is not None and self.max_open < 1:
            raise ConfigError("arrival.max_open must be >= 1")


@dataclass(frozen=True, slots=True)
class BranchingConfig:
    probability: float = 0.0
    fork_factor: int = 2
    max_depth: int = 1
    branch_turns: Dist = field(default_factory=lambda: Dist.fixed(1))

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ConfigError(f"branching.probability must be in [0, 1], got {self.probability}")
        if self.fork_factor < 1 or self.max_depth < 0:
            raise ConfigError("branching.fork_factor must be >= 1 and max_depth >= 0")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    name: str = "default-agent"
    seed: int = 0
    vocab_size: int = 32000
    arrival: ArrivalConfig = field(default_factory=ArrivalConfig)
    turns: Dist = field(default_factory=lambda: Dist("uniform", 6, 30))
    task_tokens: Dist = field(default_factory=lambda: Dist("lognormal", 800, 0.6, hi=8000))
    observation_tokens: Dist = field(default_factory=lambda: Dist("lognormal", 400, 1.3, hi=30000))
    output_tokens: Dist = field(default_factory=lambda: Dist("lognormal", 150, 0.7, 8, 2000))
    max_context_tokens: int = 120_000
    system_tokens: int = 2000
    tool_tokens: int = 3000
    layout: str = "stable"
    volatile_after: str = "head"
    tools: tuple[ToolSpec, ...] = (
        ToolSpec("bash", 0.6, Dist("lognormal", 2, 0.8)),
        ToolSpec("tests", 0.35, Dist("lognormal", 30, 0.6)),
        ToolSpec("human", 0.05, Dist("lognormal", 180, 0.7)),
    )
    branching: BranchingConfig = field(
        default_factory=lambda: BranchingConfig(0.05, 3, 1, Dist("uniform", 1, 3))
    )
    pause_hints: str = "median"

    def __post_init__(self) -> None:
        if self.vocab_size < 16:
            raise ConfigError(f"vocab_size must be >= 16, got {self.vocab_size}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"shared_prefix.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.volatile_after not in VOLATILE_ZONES:
            raise ConfigError(
                f"shared_prefix.volatile_after must be one of {VOLATILE_ZONES}, "
                f"got {self.volatile_after!r}"
            )
        if self.pause_hints not in PAUSE_HINTS:
            raise ConfigError(f"pause_hints must be one of {PAUSE_HINTS}, got {self.pause_hints!r}")
        if self.system_tokens < 0 or self.tool_tokens < 0:
            raise ConfigError("shared_prefix token counts must not be negative")
        if self.max_context_tokens < 2:
            raise ConfigError("trajectory.max_context_tokens must be >= 2")
        if not self.tools or sum(t.weight for t in self.tools) <= 0:
            raise ConfigError("tools: give at least one tool with a positive weight")
        if any(t.weight < 0 for t in self.tools):
            raise ConfigError("tools: weights must not be negative")

    @property
    def shared_tokens(self) -> int:
        return self.system_tokens + self.tool_tokens

    @classmethod
    def default(cls) -> WorkloadConfig:
        return cls.from_yaml_text(DEFAULT_WORKLOAD_YAML, "the built-in default workload")

    @classmethod
    def from_yaml(cls, path: Path | str) -> WorkloadConfig:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read workload {p}: {exc}") from exc
        return cls.from_yaml_text(text, str(p))

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "workload") -> WorkloadConfig:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source} is not valid YAML: {exc}") from exc
        return cls.from_dict(data or {}, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "workload") -> WorkloadConfig:
        try:
            return _from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc


def _section(data: dict[str, Any], key: str, known: set[str]) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping, got {value!r}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {key}; known: {sorted(known)}")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    return int(value)


def _from_dict(data: Any) -> WorkloadConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"a workload is a mapping of sections, got {type(data).__name__}")
    top = {
        "name",
        "seed",
        "vocab_size",
        "arrival",
        "trajectory",
        "shared_prefix",
        "tools",
        "pause_hints",
    }
    unknown = sorted(set(data) - top - {"branching"})
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; known: {sorted(top | {'branching'})}")
    base = WorkloadConfig()
    kw: dict[str, Any] = {}
    if "name" in data:
        kw["name"] = str(data["name"])
    if "seed" in data:
        kw["seed"] = _int(data["seed"], "seed")
    if "vocab_size" in data:
        kw["vocab_size"] = _int(data["vocab_size"], "vocab_size")
    if "pause_hints" in data:
        kw["pause_hints"] = str(data["pause_hints"])

    arr = _section(data, "arrival", {"concurrent", "rate_per_s", "ramp_s", "max_open"})
    if arr:
        rate = arr.get("rate_per_s")
        conc = arr.get("concurrent")
        if rate is not None and conc is None:
            conc_value: int | None = None
        else:
            conc_value = _int(conc if conc is not None else 128, "arrival.concurrent")
        kw["arrival"] = ArrivalConfig(
            concurrent=conc_value,
            rate_per_s=None if rate is None else float(rate),
            ramp_s=float(arr.get("ramp_s", 60.0)),
            max_open=None if arr.get("max_open") is None else _int(arr["max_open"], "max_open"),
        )

    traj_keys = {"turns", "task_tokens", "observation_tokens", "output_tokens"}
    traj = _section(data, "trajectory", traj_keys | {"max_context_tokens"})
    for key in traj_keys & set(traj):
        kw[key] = parse_dist(traj[key], f"trajectory.{key}")
    if "max_context_tokens" in traj:
        kw["max_context_tokens"] = _int(traj["max_context_tokens"], "max_context_tokens")

    shared = _section(
        data, "shared_prefix", {"system_tokens", "tool_tokens", "layout", "volatile_after"}
    )
    for key in ("system_tokens", "tool_tokens"):
        if key in shared:
            kw[key] = _int(shared[key], f"shared_prefix.{key}")
    for key in ("layout", "volatile_after"):
        if key in shared:
            kw[key] = str(shared[key])

    if "tools" in data:
        tools = data["tools"]
        if not isinstance(tools, dict) or not tools:
            raise ConfigError("tools must be a non-empty mapping of tool name to {weight, wait}")
        specs = []
        for name, spec in tools.items():
            if not isinstance(spec, dict) or "wait" not in spec:
                raise ConfigError(f"tools.{name} needs a wait (a number or a distribution)")
            extra = sorted(set(spec) - {"weight", "wait"})
            if extra:
                raise ConfigError(f"unknown key(s) {extra} in tools.{name}; known: weight, wait")
            specs.append(
                ToolSpec(
                    str(name),
                    float(spec.get("weight", 1.0)),
                    parse_dist(spec["wait"], f"tools.{name}.wait"),
                )
            )
        kw["tools"] = tuple(specs)

    br = _section(data, "branching", {"probability", "fork_factor", "max_depth", "branch_turns"})
    if "branching" in data:
        d = base.branching
        kw["branching"] = BranchingConfig(
            probability=float(br.get("probability", d.probability)),
            fork_factor=_int(br.get("fork_factor", d.fork_factor), "branching.fork_factor"),
            max_depth=_int(br.get("max_depth", d.max_depth), "branching.max_depth"),
            branch_turns=parse_dist(br.get("branch_turns", 1), "branching.branch_turns"),
        )
    return WorkloadConfig(**kw)
