"""Model fingerprints: cache keys that outlive a process never mix models.

The chained block hash is seeded with the model's fingerprint (weights identity, KV dtype,
block size, config), the disk tier records whose KV it holds and drops another model's, and
the session store does not resume another model's session. Two checkpoints of the same shape
sharing one disk folder read none of each other's blocks.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from kvpilot.engine import Engine, SamplingParams
from kvpilot.memory import ModelFingerprint, Tier
from kvpilot.memory.hashing import chain_hashes, root_hash
from kvpilot.model.checkpoints import make_checkpoint
from kvpilot.model.runner import ModelRunner
from kvpilot.store import DiskBlockStore, SessionStore

from equivalence import FIRST, SECOND, LogitRecorder, assert_same_turns, reference_turns, settle

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def bf16_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with its weights saved in bfloat16."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    half = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    save_file(half, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama checkpoints of one shape: seed 0, seed 1, and seed 0 saved in bfloat16."""
    root = tmp_path_factory.mktemp("twins")
    seed0 = make_checkpoint("llama", root / "seed0", seed=0)
    return {
        "seed0": seed0,
        "seed1": make_checkpoint("llama", root / "seed1", seed=1),
        "seed0-bf16": bf16_copy(seed0, root / "seed0-bf16"),
    }


def fingerprint(path: Path, **options: object) -> ModelFingerprint:
    kwargs: dict[str, object] = {"num_blocks": 4}
    kwargs.update(options)
    return ModelRunner(path, **kwargs).fingerprint  # type: ignore[arg-type]


def test_fingerprint_names_weights_dtypes_and_block_size(twins: dict[str, Path]) -> None:
    base = fingerprint(twins["seed0"])
    assert fingerprint(twins["seed0"]) == base  # deterministic
    others = [
        fingerprint(twins["seed1"]),
        fingerprint(twins["seed0-bf16"]),
        fingerprint(twins["seed0"], dtype="bfloat16"),
        fingerprint(twins["seed0"], block_size=8),
    ]
    digests = {base.digest, *(f.digest for f in others)}
    assert len(digests) == 5
    assert "seed0" in base.label and "float32 KV" in base.label and "block size 16" in base.label


def test_the_fingerprint_seeds_every_chained_hash(twins: dict[str, Path]) -> None:
    engines = [Engine.from_pretrained(str(twins[n]), kv_blocks=32) for n in ("seed0", "seed1")]
    roots = {e.kv.radix.root("tenant").last_hash() for e in engines}
    assert len(roots) == 2 and root_hash("tenant") not in roots
    a, b = (e.executor.fingerprint.digest for e in engines)
    assert roots == {root_hash("tenant", a), root_hash("tenant", b)}
    assert set(chain_hashes(FIRST, 16, None, a)).isdisjoint(chain_hashes(FIRST, 16, None, b))


def test_the_simulator_fingerprints_its_geometry() -> None:
    from kvpilot.sim.build import SimSetup, build_engine

    small, _ = build_engine(SimSetup(model="llama-3-8b"), 32000)
    large, _ = build_engine(SimSetup(model="llama-3-70b"), 32000)
    labels = [e.executor.fingerprint.label for e in (small, large)]
    assert "llama-3-8b" in labels[0] and "llama-3-70b" in labels[1]
    assert small.executor.fingerprint.digest != large.executor.fingerprint.digest


def pause_to_disk(model: Path, disk: Path) -> int:
    """Session "agent-1" of ``model`` runs FIRST and pauses to disk; returns blocks written."""
    engine = Engine.from_pretrained(
        str(model), kv_blocks=128, disk_dir=str(disk), pause_policy="offload-disk"
    )
    session = engine.open_session(session_id="agent-1")
    session.generate(FIRST, PARAMS)
    session.pause(expected_wait_s=600.0, tool="human-review")
    settle(engine)
    assert engine.offload.disk is not None
    written = len(engine.offload.disk)
    engine.close()
    return written


@pytest.mark.parametrize("second", ["seed1", "seed0-bf16", "seed0 with bf16 KV"])
def test_same_shaped_checkpoints_sharing_a_disk_folder_read_none_of_each_others_kv(
    second: str, twins: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "shared-disk"
    assert pause_to_disk(twins["seed0"], disk) >= len(FIRST) // 16
    model, dtype = (twins["seed0"], "bfloat16") if second.endswith("KV") else (twins[second], None)
    options: dict[str, object] = {"kv_blocks": 128, "disk_dir": str(disk)}
    options["pause_policy"] = "offload-disk"
    if dtype is not None:
        options["dtype"] = dtype
    with caplog.at_level(logging.WARNING):
        engine = Engine.from_pretrained(str(model), **options)
        store = engine.offload.disk
        assert store is not None
        probed = store.stats.blocks_read  # the bandwidth probe's own two blocks
        # The old failure: resuming the other model's session took its KV from disk.
        recorder = LogitRecorder(engine)
        session = engine.open_session(session_id="agent-1")
        rid = session.submit(SECOND, PARAMS)
        request = engine.requests[rid]
        turn = recorder.finish(rid)
    assert request.cached_by_tier["disk"] == 0
    assert store.stats.blocks_read == probed
    assert len(store) == 0 and "holds the KV of model seed0 (llama, float32 KV" in caplog.text
    assert session.num_tokens == len(SECOND) + 8 and "not resumed" in caplog.text
    if dtype is None:
        assert_same_turns([turn], reference_turns(model, [SECOND]))
    engine.close()


def test_keys_alone_keep_models_apart_in_one_store(twins: dict[str, Path], tmp_path: Path) -> None:
    """Even in a store that kept another model's rows, no key of one model names the other's."""
    disk = tmp_path / "disk"
    written = pause_to_disk(twins["seed0"], disk)
    a, b = (fingerprint(twins[n]).digest for n in ("seed0", "seed1"))
    with DiskBlockStore(
        disk, 4096, ModelRunner(twins["seed0"], num_blocks=4).kv_bytes_per_block
    ) as s:
        assert len(s) == written
        assert sum(map(s.contains, chain_hashes(FIRST, 16, None, a))) == len(FIRST) // 16
        assert sum(map(s.contains, chain_hashes(FIRST, 16, None, b))) == 0
        assert sum(map(s.contains, chain_hashes(FIRST, 16))) == 0


def _model(name: str) -> ModelFingerprint:
    return ModelFingerprint.of(name)


def test_a_store_of_another_model_is_ignored_with_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DiskBlockStore(tmp_path, 8, 64, fsync=False, model=_model("A")) as store:
        store.put_many([(bytes([i]) * 16, bytes(64)) for i in range(3)]).result()
    with DiskBlockStore(tmp_path, 8, 64, fsync=False, model=_model("A")) as store:
        assert len(store) == 3  # its own model: kept
    with caplog.at_level(logging.WARNING), DiskBlockStore(tmp_path, 8, 64, model=_model("B")) as s:
        assert len(s) == 0
        s.check_invariants()
    assert "holds the KV of model A; this engine runs B: its 3 blocks are ignored" in caplog.text
    # Another model may bring another geometry: the store starts over in it.
    with DiskBlockStore(tmp_path, 4, 128, fsync=False, model=_model("C")) as store:
        assert store.put(bytes(16), bytes(128)).result() and len(store) == 1
        store.check_invariants()
    with DiskBlockStore(tmp_path, 4, 128, fsync=False) as store:
        assert len(store) == 1  # opened without a model (a tool reading it): kept


def test_another_models_session_is_not_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with SessionStore(tmp_path, model=_model("A")) as store:
        store.save("s", [1, 2, 3], None, {})
    with SessionStore(tmp_path, model=_model("A")) as store:
        loaded = store.load("s")
        assert loaded is not None and loaded.tokens == [1, 2, 3]
    with caplog.at_level(logging.WARNING), SessionStore(tmp_path, model=_model("B")) as store:
        assert store.load("s") is None
    assert "was saved by model A; this engine runs B: not resumed" in caplog.text


def test_a_version_1_session_store_is_migrated(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "sessions.sqlite3")
    conn.executescript(
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, tokens BLOB NOT NULL, salt TEXT,"
        " meta TEXT NOT NULL, saved_at REAL NOT NULL); PRAGMA user_version=1;"
        "INSERT INTO sessions VALUES ('old', x'01000000', NULL, '{}', 1.0);"
    )
    conn.close()
    with SessionStore(tmp_path) as store:
        loaded = store.load("old")
        assert loaded is not None and loaded.tokens == [1]
    with SessionStore(tmp_path, model=_model("A")) as store:
        assert store.load("old") is None  # no recorded model: not this one's
        store.save("new", [2], None, {})
        assert store.load("new") is not None


def test_resident_kv_is_unaffected(twins: dict[str, Path]) -> None:
    """The seed changes keys, not contents: a model still shares its own prefixes."""
    engine = Engine.from_pretrained(str(twins["seed0"]), kv_blocks=64)
    engine.generate(FIRST, PARAMS)
    out = engine.generate(FIRST, PARAMS)[0]
    assert out.cached_tokens == (len(FIRST) - 1) // 16 * 16
    assert engine.kv.radix.cached_blocks(Tier.DEVICE) > 0
