"""Tiers under tensor parallelism: a session paused to host or disk under TP=2 resumes with
the logits a TP=1 recompute of the same turns gives; each rank's shard goes to its own store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from equivalence import (
    FIRST,
    SECOND,
    THIRD,
    assert_same_turns,
    disk_dir,
    reference_turns,
    tiered,
    turns_with_pauses,
)


@pytest.mark.parametrize("policy", ["offload-host", "offload-disk"])
def test_a_session_paused_under_tp2_resumes_with_tp1_logits(
    policy: str, hf_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    model = hf_checkpoint("qwen2")
    engine = tiered(model, tmp_path, policy, tensor_parallel_size=2)
    try:
        got = turns_with_pauses(engine)
        moved = engine.offload.stats.bytes_moved
    finally:
        engine.close()
    assert_same_turns(got, reference_turns(model, [FIRST, SECOND, THIRD]))
    if policy == "offload-host":
        assert moved["device_to_host"] > 0 and moved["host_to_device"] > 0
    else:
        assert moved["device_to_disk"] > 0 and moved["disk_to_device"] > 0
        folder = disk_dir(tmp_path, policy) / "tp2"
        assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1"]
