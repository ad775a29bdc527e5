"""The break-even rule for a paused trajectory's KV state: retain, offload to host or disk, or drop.

This is the one implementation of the spec's rule ("Retain, Evict, Recompute, or Offload");
`kvpilot plan --pause` and the engine's pause policy both call `decide_pause`.

Figures, for M = kv_bytes, S = num_tokens, T = expected_wait_s:
    reload_s        = M / B_link                   (B_link: aggregate device<->host bandwidth)
    round_trip_s    = 2 M / B_link                 (out now, back before the resume)
    disk_reload_s   = M / min(B_link, B_disk)      (disk<->host<->device, pipelined)
    recompute_s     = S / prefill_tokens_per_s, or 2 P S / R_prefill
    recompute_cost  = recompute_s * max(1, U / M)  (U: device_used_bytes when given: a
                      recompute takes the device's compute from every trajectory on it, a copy
                      runs beside them; unknown (0): recompute_s)
    held_gb_s       = M T / 1e9                    (the memory-time tax of retaining)
    T*_wait         = RT * mu_dev / (mu_dev - mu_tier) + stall_tolerance_s
                      (infinite when mu_dev <= mu_tier: the tier is no cheaper than device memory)

Rule, in order:
 1. device_pressure < thresholds.device_plentiful_below: RETAIN (nobody needs the memory).
 2. Pick the tier the state would go to. DISK when the host cannot hold M
    (host_free_bytes < M), or when host_pressure >= thresholds.host_pressure_high and the disk
    round trip is at most thresholds.negligible_round_trip_fraction of the wait; HOST otherwise.
    With thresholds.disk_only_when_negligible, a host without room sends the state to disk
    only when that round trip is negligible too (else the way out is DROP).
    A tier with zero bandwidth does not exist: with no disk and no host room there is no tier.
 3. If there is no tier, or recompute_cost < that tier's reload time: the way out is DROP
    (recompute on return), whose round trip is recompute_cost and whose residency costs
    nothing.
 4. RT and mu_tier are those of the chosen way out (host: host_pressure; disk and drop: 0).
    If T <= RT, or T <= T*_wait: RETAIN (moving the state would not pay for itself).
 5. Otherwise take the way out: OFFLOAD_HOST, OFFLOAD_DISK or DROP; with
    thresholds.defer_drop, DROP becomes RETAIN (the engine's reclaim drops at once, when the
    memory is needed, so dropping early only recomputes state nobody needed freed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpilot.policy.pause_inputs import PauseInputs
from kvpilot.units import format_bytes, format_seconds


class PauseAction(StrEnum):
    RETAIN = "retain"
    OFFLOAD_HOST = "offload_host"
    OFFLOAD_DISK = "offload_disk"
    DROP = "drop"
    # Not chosen by the rule: the pause-unaware baseline (unlock and leave the blocks in the
    # prefix cache, where LRU eviction decides their fate) is recorded under this action.
    CACHE = "cache"

    @property
    def label(self) -> str:
        """The decision in words, as a reason sentence starts: "Offload to host"."""
        return _LABELS[self]


_LABELS = {
    PauseAction.RETAIN: "Retain",
    PauseAction.OFFLOAD_HOST: "Offload to host",
    PauseAction.OFFLOAD_DISK: "Offload to disk",
    PauseAction.DROP: "Drop",
    PauseAction.CACHE: "Leave to the cache",
}


# Module constants: an enum member's class attribute lookup is slow, and every pause decides.
_RETAIN, _DROP = PauseAction.RETAIN, PauseAction.DROP
_HOST, _DISK = PauseAction.OFFLOAD_HOST, PauseAction.OFFLOAD_DISK


def action_label(action: str) -> str:
    """A recorded action's words in lower case ("offload to host"); unknown names as given."""
    try:
        return PauseAction(action).label.lower()
    except ValueError:
        return action


@dataclass(frozen=True, slots=True)
class PauseThresholds:
    """Where "plentiful", "high" and "negligible" start in the rule (see the module docstring)."""

    device_plentiful_below: float = 0.5
    host_pressure_high: float = 0.75
    negligible_round_trip_fraction: float = 0.01
    # Where memory pressure demotes idle state the moment memory is needed (the engine's
    # reclaim), dropping loses nothing by waiting until then: a drop's way out is taken then,
    # not at the pause, so state nobody ends up needing is never recomputed.
    defer_drop: bool = False
    # Disk only where its round trip is negligible next to the wait (as for a pressed host),
    # also when the host has no room: a wait predicted from past waits is uncertain, and a
    # disk reload no faster than recomputing leaves a prefetch no margin for an early return.
    disk_only_when_negligible: bool = False


DEFAULT_THRESHOLDS = PauseThresholds()
# In the engine, device memory under the admission ceiling is not contended: when admission
# needs room, idle state in its way is demoted then (`kvpilot.engine.reclaim`). Memory's
# shadow price is zero while that constraint is slack, so a pause moves state only once
# pressure reaches 1 (work waiting for memory, or held usage at tau_high). Measured on
# bench_pause's simulated node: at 0.5 the rule moved state the device had room for, filled
# the host, and recomputed 35% more than at 1.0.
# A drop is deferred to that reclaim (`defer_drop`): measured there, dropping at the pause
# recomputed state the device would have kept.
# Disk is for waits its round trip is negligible next to (`disk_only_when_negligible`): on the
# simulated node (NVMe about as fast as recomputing), disk offloads of 1 s tool waits lost
# turns/s and doubled the p99 resume on two of three workload draws.
ENGINE_THRESHOLDS = PauseThresholds(
    device_plentiful_below=1.0, defer_drop=True, disk_only_when_negligible=True
)


@dataclass(slots=True, unsafe_hash=True)  # a value, not frozen: see `pause_inputs.PauseInputs`
class PauseDecision:
    """The action, a sentence saying why, and every figure the rule looked at.

    `reload_vs_recompute` is recompute_s / reload_s: how many times faster reloading from host
    is than recomputing (above 1, reload wins). `break_even_wait_s` is T*_wait for the way out
    the rule considered (host, disk or drop); `via` names that way out.

    The rule's own decisions (`decide_pause`) word their ``reason`` when it is first read:
    they carry the rule's inputs (``basis``) and an empty ``reason``, and the engine decides
    far more pauses than anyone reads. A decision copied with another ``reason``
    (`dataclasses.replace`) says that one; equality, hashing, pickling and ``repr`` read the
    sentence like any field. A decision step 1 of the rule takes (plentiful device memory:
    almost every pause in the engine) needs no figure to decide: it is built with only its
    action and basis (`_deferred`), and its figures are worked out together when the first
    of them is read, by the same function (`_figure_values`) as a decision built whole.
    """

    action: PauseAction
    reason: str
    via: PauseAction
    reload_s: float
    round_trip_s: float
    recompute_s: float
    reload_vs_recompute: float
    held_gb_s: float
    break_even_wait_s: float
    disk_reload_s: float
    disk_round_trip_s: float
    basis: tuple[PauseInputs, PauseThresholds] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.reason and self.basis is not None:
            object.__delattr__(self, "reason")  # worded when first read (__getattr__)

    if not TYPE_CHECKING:  # the type checker sees ``reason: str``, and no other attribute

        def __getattr__(self, name: str) -> Any:
            # Only reached for an empty slot: a reason not worded yet, or the figures of a
            # decision built `_deferred`.
            basis = self.basis if name in _LAZY_FIELDS else None
            if basis is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            if name == "reason":
                text = _rule(*basis, _figures(*basis), True)[1]
                object.__setattr__(self, "reason", text)
                return text
            for figure, value in zip(_FIGURE_FIELDS, _figure_values(*basis), strict=True):
                object.__setattr__(self, figure, value)
            return object.__getattribute__(self, name)

    @classmethod
    def _deferred(
        cls, action: PauseAction, basis: tuple[PauseInputs, PauseThresholds]
    ) -> PauseDecision:
        """A decision of the rule with only its action and basis set: its reason and figures
        are worked out from the basis when first read (`__getattr__`)."""
        decision = object.__new__(cls)
        decision.action = action
        decision.basis = basis
        return decision


# The fields a rule's decision may leave empty until read (see `PauseDecision`), the figures
# in the order `_figure_values` gives them.
_FIGURE_FIELDS = (
    "via",
    "reload_s",
    "round_trip_s",
    "recompute_s",
    "reload_vs_recompute",
    "held_gb_s",
    "break_even_wait_s",
    "disk_reload_s",
    "disk_round_trip_s",
)
_LAZY_FIELDS = frozenset(("reason", *_FIGURE_FIELDS))


def _transfer_s(nbytes: float, bw: float) -> float:
    if nbytes == 0:
        return 0.0
    return nbytes / bw if bw > 0 else math.inf


def _break_even(round_trip: float, mu_device: float, mu_tier: float, stall: float) -> float:
    if mu_device <= mu_tier:
        return math.inf
    return round_trip * mu_device / (mu_device - mu_tier) + stall


class _Figures(NamedTuple):
    """What the rule computes before it decides (steps 2-4 of the module docstring)."""

    reload_s: float
    disk_reload_s: float
    recompute_s: float
    share: float  # recompute_cost / recompute_s
    recompute_cost: float
    via: PauseAction
    tier_reload: float
    mu_tier: float
    way_out_rt: float
    t_star: float
    disk_exists: bool


def _figures(inputs: PauseInputs, thresholds: PauseThresholds) -> _Figures:
    m, wait = inputs.kv_bytes, inputs.expected_wait_s
    reload_s = _transfer_s(m, inputs.device_host_bw_bytes_s)
    disk_bw = min(inputs.device_host_bw_bytes_s, inputs.host_disk_bw_bytes_s)
    disk_reload_s = _transfer_s(m, disk_bw)
    recompute_s = inputs.recompute_s
    share = max(1.0, inputs.device_used_bytes / m) if m > 0 else 1.0
    recompute_cost = recompute_s * share

    host_room = inputs.host_free_bytes >= m and not math.isinf(reload_s)
    disk_exists = not math.isinf(disk_reload_s)
    disk_negligible = 2 * disk_reload_s <= thresholds.negligible_round_trip_fraction * wait
    host_pressed = inputs.host_pressure >= thresholds.host_pressure_high
    disk_ok = disk_negligible or not thresholds.disk_only_when_negligible
    if disk_exists and ((not host_room and disk_ok) or (host_pressed and disk_negligible)):
        via, tier_reload, mu_tier = _DISK, disk_reload_s, 0.0
    elif host_room:
        via, tier_reload, mu_tier = _HOST, reload_s, inputs.host_pressure
    else:
        via, tier_reload, mu_tier = _DROP, math.inf, 0.0
    if recompute_cost < tier_reload:
        via, mu_tier = _DROP, 0.0
    way_out_rt = recompute_cost if via is _DROP else 2 * tier_reload
    t_star = _break_even(way_out_rt, inputs.device_pressure, mu_tier, inputs.stall_tolerance_s)
    return _Figures(
        reload_s,
        disk_reload_s,
        recompute_s,
        share,
        recompute_cost,
        via,
        tier_reload,
        mu_tier,
        way_out_rt,
        t_star,
        disk_exists,
    )


def _figure_values(
    inputs: PauseInputs, thresholds: PauseThresholds, f: _Figures | None = None
) -> tuple[PauseAction, float, float, float, float, float, float, float, float]:
    """A decision's figures, in the order of `_FIGURE_FIELDS` (``f``: `_figures`, when known)."""
    if f is None:
        f = _figures(inputs, thresholds)
    reload_s, recompute_s = f.reload_s, f.recompute_s
    return (
        f.via,
        reload_s,
        2 * reload_s,
        recompute_s,
        recompute_s / reload_s if reload_s > 0 else math.inf,
        inputs.kv_bytes / 1e9 * inputs.expected_wait_s,
        f.t_star,
        f.disk_reload_s,
        2 * f.disk_reload_s,
    )


def decide_pause(
    inputs: PauseInputs, thresholds: PauseThresholds = DEFAULT_THRESHOLDS
) -> PauseDecision:
    """Apply the break-even rule of the module docstring to one paused trajectory."""
    basis = (inputs, thresholds)
    # Step 1 (`_plentiful`, read in place: almost every engine pause ends here) decides on
    # the pressure alone.
    if inputs.device_pressure < thresholds.device_plentiful_below:
        return PauseDecision._deferred(_RETAIN, basis)
    f = _figures(inputs, thresholds)
    action = _rule(inputs, thresholds, f, False)[0]
    # The reason is worded when read, from the basis.
    return PauseDecision(action, "", *_figure_values(inputs, thresholds, f), basis=basis)


def _plentiful(inputs: PauseInputs, thresholds: PauseThresholds) -> bool:
    """Step 1 of the rule: device memory is plentiful, so the state is retained."""
    return inputs.device_pressure < thresholds.device_plentiful_below


def _rule(
    inputs: PauseInputs, thresholds: PauseThresholds, f: _Figures, words: bool
) -> tuple[PauseAction, str]:
    """The rule's action (steps 1, 4 and 5), and with ``words`` the sentence saying why."""
    m, wait = inputs.kv_bytes, inputs.expected_wait_s
    via, way_out_rt, t_star, mu_tier = f.via, f.way_out_rt, f.t_star, f.mu_tier
    recompute_s, disk_reload_s = f.recompute_s, f.disk_reload_s
    size, s = (format_bytes(m) if words else ""), format_seconds
    if _plentiful(inputs, thresholds):
        return _RETAIN, (
            f"Retain: device memory is plentiful (pressure {inputs.device_pressure:.2f}, under "
            f"{thresholds.device_plentiful_below:.2f}), so holding {size} for {s(wait)} costs "
            "nobody anything."
            if words
            else ""
        )
    if wait <= way_out_rt:
        if not words:
            return _RETAIN, ""
        way_out = {
            PauseAction.OFFLOAD_HOST: f"the {s(way_out_rt)} host round trip",
            PauseAction.OFFLOAD_DISK: f"the {s(way_out_rt)} disk round trip",
            PauseAction.DROP: f"the {s(recompute_s)} it takes to recompute"
            + ("" if f.share == 1.0 else f" ({s(way_out_rt)} of the whole device's time)"),
        }[via]
        return PauseAction.RETAIN, (
            f"Retain: the {s(wait)} wait is shorter than {way_out}, so moving {size} out "
            "would delay the resume."
        )
    if wait <= t_star:
        if not words:
            return _RETAIN, ""
        if math.isinf(t_star):
            why = (
                f"host memory is as contended as device memory ({mu_tier:.2f} against "
                f"{inputs.device_pressure:.2f}), so moving {size} there would free nothing scarcer"
                if via is PauseAction.OFFLOAD_HOST
                else f"device memory is under no pressure, so freeing {size} gains nothing"
            )
            return PauseAction.RETAIN, f"Retain: {why}."
        return PauseAction.RETAIN, (
            f"Retain: the {s(wait)} wait is under the {s(t_star)} break-even wait (device "
            f"pressure {inputs.device_pressure:.2f} against {mu_tier:.2f} where the state "
            f"would go), so holding {size} costs less than moving it."
        )
    if not words:
        if via is _DROP and thresholds.defer_drop:
            return _RETAIN, ""
        return via, ""
    past = f"the {s(wait)} wait is past the {s(t_star)} break-even"
    if not math.isclose(t_star, way_out_rt, rel_tol=0.05):
        past += f" ({s(way_out_rt)} round trip)"
    if via is PauseAction.DROP:
        tier_reload = f.tier_reload
        if math.isinf(tier_reload) and f.disk_exists:
            why = (
                f"there is no host room, and the {s(2 * disk_reload_s)} disk round trip is not "
                f"negligible next to the {s(wait)} wait"
            )
        elif math.isinf(tier_reload):
            why = "there is no host room and no disk tier"
        else:
            why = f"recomputing ({s(f.recompute_cost)}) is faster than reloading ({s(tier_reload)})"
        if thresholds.defer_drop:
            return PauseAction.RETAIN, (
                f"Retain until the memory is needed: {why} and {past}, but dropping is "
                f"instant, so {size} is dropped only if memory pressure demotes it."
            )
        return PauseAction.DROP, (
            f"Drop: {why}, and {past}, so {size} is freed now and recomputed on return."
        )
    if via is PauseAction.OFFLOAD_DISK:
        why = (
            f"the host has room for only {format_bytes(inputs.host_free_bytes)} and {past}"
            if inputs.host_free_bytes < m
            else f"host memory is under pressure ({inputs.host_pressure:.2f}) and the "
            f"{s(2 * disk_reload_s)} disk round trip is negligible next to the {s(wait)} wait"
        )
        return PauseAction.OFFLOAD_DISK, (
            f"Offload to disk: {why}, so reloading {size} later ({s(disk_reload_s)}) beats "
            f"recomputing it ({s(recompute_s)})."
        )
    reload_s = f.reload_s
    faster = f"{recompute_s / reload_s:.0f}x faster than" if reload_s > 0 else "free next to"
    return PauseAction.OFFLOAD_HOST, (
        f"Offload to host: {past}, and reloading {size} ({s(reload_s)}) is {faster} "
        f"recomputing it ({s(recompute_s)})."
    )
