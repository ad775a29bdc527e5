"""What the break-even rule is told about one paused trajectory and the machine (`PauseInputs`),
and the longest wait a pause is planned for (`MAX_WAIT_S`, `clamp_wait_s`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.errors import ConfigError

# The longest wait a pause is planned for (30 days): the API refuses longer hints, and the
# policy code clamps whatever reaches it, so no timer or figure can overflow.
MAX_WAIT_S = 30 * 86400.0


def clamp_wait_s(wait_s: float) -> float:
    """A wait in [0, MAX_WAIT_S] (NaN counts as 0)."""
    if not wait_s >= 0.0:
        return 0.0
    wait_s = float(wait_s)
    return MAX_WAIT_S if wait_s > MAX_WAIT_S else wait_s  # min(wait_s, MAX_WAIT_S), no builtin


# The engine builds a `PauseInputs` and a `PauseDecision` per pause. Neither is frozen: a
# frozen dataclass's generated __init__ sets each field through object.__setattr__, which
# CPython 3.11 runs at ~1,300 instructions a field against ~100 for a plain slot store
# (27 fields: ~35k instructions a pause). Both are values all the same: nothing assigns to
# them once built (`dataclasses.replace` makes changed copies), and they hash by value
# (``unsafe_hash``: the hash a frozen dataclass would have).
@dataclass(slots=True, unsafe_hash=True)
class PauseInputs:
    """What the rule needs to know about one paused trajectory and the machine.

    Give the prefill rate either as `prefill_tokens_per_s`, or as `num_params` with
    `prefill_flops_per_s` (sustained, i.e. peak times MFU). Pressures are shadow prices of
    memory in [0, 1]: e.g. KV usage, or 1 when work is waiting for device memory.
    A bandwidth of 0 means that tier is absent.
    """

    kv_bytes: float
    num_tokens: int
    expected_wait_s: float
    device_host_bw_bytes_s: float
    host_disk_bw_bytes_s: float
    prefill_tokens_per_s: float | None = None
    num_params: float | None = None
    prefill_flops_per_s: float | None = None
    device_pressure: float = 1.0
    host_pressure: float = 0.0
    host_free_bytes: float = math.inf
    stall_tolerance_s: float = 0.0
    # Device bytes in use by every trajectory (0: unknown): a recompute stalls them all.
    device_used_bytes: float = 0.0
    # Context baselines read (the rule does not): the tool paused on, its recent waits.
    tool: str | None = None
    tool_waits: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # The engine builds one per pause: one chain of comparisons, in the order of the
        # checks that name what is wrong (`_check_figures`, run only when one fails).
        if (
            self.kv_bytes < 0
            or self.num_tokens < 0
            or self.expected_wait_s < 0
            or self.device_host_bw_bytes_s < 0
            or self.host_disk_bw_bytes_s < 0
            or self.host_free_bytes < 0
            or self.stall_tolerance_s < 0
            or self.device_used_bytes < 0
            or not 0.0 <= self.device_pressure <= 1.0
            or not 0.0 <= self.host_pressure <= 1.0
        ):
            self._check_figures()
        rate = self.prefill_tokens_per_s
        if rate is not None and rate > 0:
            return
        has_flops = (
            self.num_params is not None
            and self.num_params > 0
            and self.prefill_flops_per_s is not None
            and self.prefill_flops_per_s > 0
        )
        if not has_flops:
            raise ConfigError(
                "pause inputs: give a positive prefill_tokens_per_s, or num_params together "
                "with prefill_flops_per_s"
            )

    def _check_figures(self) -> None:
        for name in (
            "kv_bytes",
            "num_tokens",
            "expected_wait_s",
            "device_host_bw_bytes_s",
            "host_disk_bw_bytes_s",
            "host_free_bytes",
            "stall_tolerance_s",
            "device_used_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"pause inputs: {name} must not be negative")
        for name in ("device_pressure", "host_pressure"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"pause inputs: {name} must be in [0, 1]")

    @property
    def recompute_s(self) -> float:
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s > 0:
            return self.num_tokens / self.prefill_tokens_per_s
        assert self.num_params is not None and self.prefill_flops_per_s is not None
        return 2.0 * self.num_params * self.num_tokens / self.prefill_flops_per_s
