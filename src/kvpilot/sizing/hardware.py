"""Accelerator and node presets: memory, bandwidths and compute that sizing and costing use."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

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
    Bandwidths and FLOP rates are decimal (TB/s, TFLOP/s), as vendors quote them; FLOP rates
    are dense BF16 (datasheets also print the 2x "with sparsity" figure). Links are per
    direction, because a copy moves its bytes one way: vendors quote NVLink, NVLink-C2C,
    Infinity Fabric and "128 GB/s PCIe Gen5" as both directions together, twice these.
    ``host_link`` carries KV offloads to host memory; ``peer_link`` joins accelerators of a
    node (tensor-parallel all-reduce).
    """

    name: str
    hbm_bytes: int
    hbm_bw_bytes_s: float
    peak_flops: float
    host_link_bw_bytes_s: float
    host_link: str
    host_mem_bytes: int
    peer_link_bw_bytes_s: float | None = None
    peer_link: str | None = None

    def __post_init__(self) -> None:
        for field in (
            "hbm_bytes",
            "hbm_bw_bytes_s",
            "peak_flops",
            "host_link_bw_bytes_s",
        ):
            if getattr(self, field) <= 0:
                raise ConfigError(f"accelerator {self.name!r}: {field} must be positive")
        if self.host_mem_bytes < 0:
            raise ConfigError(f"accelerator {self.name!r}: host_mem_bytes must not be negative")
        if self.peer_link_bw_bytes_s is not None and self.peer_link_bw_bytes_s <= 0:
            raise ConfigError(f"accelerator {self.name!r}: peer_link_bw_bytes_s must be positive")


PCIE4 = 32 * GB  # PCIe Gen4 x16, per direction
PCIE5 = 64 * GB  # PCIe Gen5 x16, per direction

# Sources (public datasheets): NVIDIA A100 ("A100 Tensor Core GPU" datasheet: 1,555 GB/s on
# the 40 GB SXM part, 2,039 GB/s on the 80 GB one, 312 TFLOPS BF16, NVLink 600 GB/s);
# H100 (H100 datasheet: SXM 3.35 TB/s, 989 TFLOPS, NVLink 900 GB/s; PCIe 2.0 TB/s,
# 756 TFLOPS, NVLink bridge 600 GB/s); H200 (H200 datasheet: 141 GB, 4.8 TB/s; SXM
# 989 TFLOPS, NVLink 900 GB/s; NVL 836 TFLOPS, 2- or 4-way NVLink bridge 900 GB/s); HGX B200
# (180 GB and 8 TB/s per GPU, 2.25 PFLOPS dense BF16, NVLink 5 1.8 TB/s; DGX B200: 4 TB of
# host memory for 8 GPUs); GB200 NVL72 (13.4 TB HBM3e and 360 PFLOPS sparse BF16 over 72
# GPUs: 186 GB and 2.5 PFLOPS dense each; NVLink-C2C 900 GB/s to a Grace with 480 GB
# LPDDR5X per two GPUs); L40S (48 GB GDDR6, 864 GB/s, 362 TFLOPS BF16, PCIe Gen4, no
# NVLink); GH200 (96 GB HBM3 at 4.0 TB/s, NVLink-C2C 900 GB/s, 480 GB LPDDR5X); AMD
# Instinct MI300X (192 GB HBM3, 5.3 TB/s, 1,307.4 TFLOPS BF16, Infinity Fabric 896 GB/s
# peak aggregate) and MI325X (256 GB HBM3E, 6 TB/s, same compute and fabric).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "a100-40",
            40 * GIB,
            1.555 * TB,
            312e12,
            PCIE4,
            "PCIe Gen4 x16",
            128 * GB,
            300 * GB,
            "NVLink 3",
        ),
        Accelerator(
            "a100-80",
            80 * GIB,
            2.039 * TB,
            312e12,
            PCIE4,
            "PCIe Gen4 x16",
            256 * GB,
            300 * GB,
            "NVLink 3",
        ),
        Accelerator(
            "h100-pcie",
            80 * GIB,
            2.0 * TB,
            756e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            300 * GB,
            "NVLink bridge (pairs)",
        ),
        Accelerator(
            "h100-sxm",
            80 * GIB,
            3.35 * TB,
            989e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            450 * GB,
            "NVLink 4",
        ),
        Accelerator(
            "h200",
            141 * GIB,
            4.8 * TB,
            989e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            450 * GB,
            "NVLink 4",
        ),
        Accelerator(
            "h200-nvl",
            141 * GIB,
            4.8 * TB,
            836e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            450 * GB,
            "NVLink bridge (2- or 4-way)",
        ),
        Accelerator(
            "b200",
            180 * GIB,
            8.0 * TB,
            2250e12,
            PCIE5,
            "PCIe Gen5 x16",
            512 * GB,
            900 * GB,
            "NVLink 5",
        ),
        Accelerator(
            "gb200",
            186 * GIB,
            8.0 * TB,
            2500e12,
            450 * GB,
            "NVLink-C2C",
            240 * GB,
            900 * GB,
            "NVLink 5",
        ),
        Accelerator(
            "l40s",
            48 * GIB,
            0.864 * TB,
            362e12,
            PCIE4,
            "PCIe Gen4 x16",
            128 * GB,
            PCIE4,
            "PCIe Gen4 (no NVLink)",
        ),
        # GH200 in its original 96 GB HBM3 form (4.0 TB/s); the 144 GB HBM3e part is faster.
        Accelerator(
            "gh200",
            96 * GIB,
            4.0 * TB,
            989e12,
            450 * GB,
            "NVLink-C2C",
            480 * GB,
            450 * GB,
            "NVLink 4",
        ),
        Accelerator(
            "mi300x",
            192 * GIB,
            5.3 * TB,
            1307.4e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            448 * GB,
            "Infinity Fabric",
        ),
        Accelerator(
            "mi325x",
            256 * GIB,
            6.0 * TB,
            1307.4e12,
            PCIE5,
            "PCIe Gen5 x16",
            256 * GB,
            448 * GB,
            "Infinity Fabric",
        ),
    )
}

_ALIASES: dict[str, str] = {
    "a100": "a100-80",
    "a100-40gb": "a100-40",
    "a100-80gb": "a100-80",
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "b200-sxm": "b200",
}


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
        changes: dict[str, Any] = {
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
