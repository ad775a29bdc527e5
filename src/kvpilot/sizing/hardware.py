"""Accelerator and node presets: memory, bandwidths and compute that sizing and costing use."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kvpilot.errors import ConfigError

GIB = 1 << 30
GB = 10**9
TB = 10**12

DEFAULT_NVME_BW_BYTES_S = 7 * GB


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator and its share of the host.

    HBM capacities are binary (GiB), as the HBM stacks are: an "80 GB" H100 holds
    85.9e9 bytes, which is why eight of them make the spec's 687.2 GB node.
    Bandwidths and FLOP rates are decimal (TB/s, TFLOP/s), as vendors quote them.
    """

    name: str
    hbm_bytes: int
    hbm_bw_bytes_s: float
    peak_flops: float
    host_link_bw_bytes_s: float
    host_link: str
    host_mem_bytes: int

    def __post_init__(self) -> None:
        for field in ("hbm_bytes", "hbm_bw_bytes_s", "peak_flops", "host_link_bw_bytes_s"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"accelerator {self.name!r}: {field} must be positive")
        if self.host_mem_bytes < 0:
            raise ConfigError(f"accelerator {self.name!r}: host_mem_bytes must not be negative")


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("h100-sxm", 80 * GIB, 3.35 * TB, 989e12, 64 * GB, "PCIe Gen5 x16", 256 * GB),
        Accelerator("h200", 141 * GIB, 4.8 * TB, 989e12, 64 * GB, "PCIe Gen5 x16", 256 * GB),
        Accelerator("b200", 192 * GIB, 8.0 * TB, 2250e12, 64 * GB, "PCIe Gen5 x16", 512 * GB),
        # GH200 in its original 96 GB HBM3 form (4.0 TB/s); the 144 GB HBM3e part is faster.
        Accelerator("gh200", 96 * GIB, 4.0 * TB, 989e12, 900 * GB, "NVLink-C2C", 480 * GB),
    )
}

_ALIASES: dict[str, str] = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "b200-sxm": "b200"}


def resolve_accelerator(name: str) -> Accelerator:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ConfigError(
            f"unknown accelerator {name!r}: use one of {', '.join(ACCELERATORS)} "
            f"(optionally as COUNTxNAME, e.g. 8xh100)"
        )
    return ACCELERATORS[key]


@dataclass(frozen=True, slots=True)
class Node:
    """`count` identical accelerators, each with its own host link, sharing one NVMe tier."""

    accelerator: Accelerator
    count: int = 1
    nvme_bw_bytes_s: float = DEFAULT_NVME_BW_BYTES_S

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ConfigError(f"a node needs at least one accelerator, got {self.count}")
        if self.nvme_bw_bytes_s < 0:
            raise ConfigError("NVMe bandwidth must not be negative")

    @property
    def name(self) -> str:
        return f"{self.count}x{self.accelerator.name}"

    @property
    def hbm_bytes(self) -> int:
        return self.count * self.accelerator.hbm_bytes

    @property
    def host_link_bw_bytes_s(self) -> float:
        """Aggregate device-host bandwidth: every accelerator moves its share over its own link."""
        return self.count * self.accelerator.host_link_bw_bytes_s

    @property
    def host_mem_bytes(self) -> int:
        return self.count * self.accelerator.host_mem_bytes

    def with_overrides(
        self,
        *,
        hbm_bytes: int | None = None,
        hbm_bw_bytes_s: float | None = None,
        peak_flops: float | None = None,
        host_link_bw_bytes_s: float | None = None,
        host_mem_bytes: int | None = None,
        nvme_bw_bytes_s: float | None = None,
    ) -> Node:
        """This node with any per-accelerator figure (or the NVMe bandwidth) replaced."""
        changes = {
            "hbm_bytes": hbm_bytes,
            "hbm_bw_bytes_s": hbm_bw_bytes_s,
            "peak_flops": peak_flops,
            "host_link_bw_bytes_s": host_link_bw_bytes_s,
            "host_mem_bytes": host_mem_bytes,
        }
        accel = dataclasses.replace(
            self.accelerator, **{k: v for k, v in changes.items() if v is not None}
        )
        nvme = self.nvme_bw_bytes_s if nvme_bw_bytes_s is None else nvme_bw_bytes_s
        return Node(accel, self.count, nvme)


_NODE_RE = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([a-z0-9][a-z0-9._-]*)\s*$", re.IGNORECASE)


def parse_node(spec: str) -> Node:
    """A node from "8xh100", "h100" (one accelerator) or "8xh100-sxm"."""
    match = _NODE_RE.match(spec)
    if match is None:
        raise ConfigError(f"cannot read node {spec!r}: write COUNTxNAME, e.g. 8xh100 or 4xb200")
    count = int(match.group(1)) if match.group(1) else 1
    return Node(resolve_accelerator(match.group(2)), count)
