"""The paged KV memory core: block pools per tier, radix prefix cache, trajectories.

Pure Python + NumPy (no torch), so the simulator and the engine share it.
"""

from __future__ import annotations

from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import ModelFingerprint, block_hash, chain_hashes, root_hash
from kvpilot.memory.manager import KVConfig, KVManager
from kvpilot.memory.radix import InsertResult, RadixCache, RadixNode, RadixStats
from kvpilot.memory.radix_node import MatchResult, PeekResult
from kvpilot.memory.residency import Residency, TierResidency
from kvpilot.memory.tiers import Tier
from kvpilot.memory.trajectory import ForkResult, Trajectory

__all__ = [
    "BlockPool",
    "ForkResult",
    "InsertResult",
    "KVConfig",
    "KVManager",
    "MatchResult",
    "ModelFingerprint",
    "PeekResult",
    "RadixCache",
    "RadixNode",
    "RadixStats",
    "Residency",
    "Tier",
    "TierResidency",
    "Trajectory",
    "block_hash",
    "chain_hashes",
    "root_hash",
]
