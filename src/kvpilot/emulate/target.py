"""Named targets to emulate: an accelerator node's reload : recompute ratios for a model.

A target is an accelerator preset (`kvpilot.sizing.hardware`), a model geometry and a TP
group, priced the way `kvpilot plan --pause` prices a pause (`kvpilot.sizing.plan.
pause_inputs` at the spec's 32k-token context): recompute is the group's prefill at MFU,
reload crosses every device's host link, a disk reload the node's NVMe. The ratios carry
over to a CPU run: with the local prefill rate P (tokens/s) and KV bytes per token b, a link
of ``link_ratio x b x P`` bytes/s makes a reload that many times faster than recomputing,
as on the target.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.errors import ConfigError
from kvpilot.policy.breakeven import decide_pause
from kvpilot.sizing.geometry import resolve_geometry
from kvpilot.sizing.hardware import Node, resolve_accelerator
from kvpilot.sizing.plan import DEFAULT_MFU, pause_inputs

# --emulate NAME -> accelerator preset (h100-pcie5: an H100 SXM behind a PCIe Gen5 x16 link)
EMULATION_TARGETS = {"h100-pcie5": "h100-sxm", "h200": "h200", "b200": "b200", "gb200": "gb200"}
TARGET_MODEL = "llama-3-70b"
TARGET_TP = 8
TARGET_CONTEXT_TOKENS = 32768


@dataclass(frozen=True, slots=True)
class EmulationTarget:
    name: str
    node: str
    model: str
    tp: int
    context_tokens: int
    reload_s: float  # host -> device for the whole context
    disk_reload_s: float  # disk -> host -> device
    recompute_s: float  # prefill of the whole context

    @property
    def link_ratio(self) -> float:
        """How many times faster a host reload is than recomputing."""
        return self.recompute_s / self.reload_s

    @property
    def disk_ratio(self) -> float:
        """How many times faster a disk reload is than recomputing (below 1: slower)."""
        return self.recompute_s / self.disk_reload_s

    def link_bytes_per_s(self, bytes_per_token: float, prefill_tokens_per_s: float) -> float:
        """The device<->host bandwidth that gives a local run this target's ratio."""
        return self.link_ratio * bytes_per_token * prefill_tokens_per_s

    def disk_bytes_per_s(self, bytes_per_token: float, prefill_tokens_per_s: float) -> float:
        return self.disk_ratio * bytes_per_token * prefill_tokens_per_s

    def describe(self) -> str:
        return (
            f"{self.name} ({self.model} on {self.node}, TP {self.tp}, {self.context_tokens:,}"
            f"-token context): reload {self.link_ratio:.0f}x faster than recompute, disk "
            f"{self.disk_ratio:.2f}x"
        )


def emulation_target(
    name: str, model: str = TARGET_MODEL, tp: int = TARGET_TP, mfu: float = DEFAULT_MFU
) -> EmulationTarget:
    key = name.strip().lower()
    if key not in EMULATION_TARGETS:
        raise ConfigError(
            f"--emulate {name!r} is unknown; choose one of {', '.join(EMULATION_TARGETS)}"
        )
    node = Node(resolve_accelerator(EMULATION_TARGETS[key]), count=tp)
    geometry = resolve_geometry(model)
    d = decide_pause(pause_inputs(geometry, node, tp, TARGET_CONTEXT_TOKENS, 1.0, mfu))
    return EmulationTarget(
        name=key,
        node=node.name,
        model=geometry.name,
        tp=tp,
        context_tokens=TARGET_CONTEXT_TOKENS,
        reload_s=d.reload_s,
        disk_reload_s=d.disk_reload_s,
        recompute_s=d.recompute_s,
    )
