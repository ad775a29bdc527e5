"""The executor interface: the one thing that differs between the real engine and the simulator.

The scheduler builds a batch of `SeqWork` items (one per running sequence) and hands it to
an executor. `ModelRunner` (PyTorch) computes KV and samples tokens; `SimulatedRunner`
advances a virtual clock by a cost model. Neither owns scheduling or memory decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvpilot.engine.sampling import SamplingParams
from kvpilot.memory.hashing import ModelFingerprint


class SeqWork(NamedTuple):
    """One sequence's share of a step (immutable; ``_replace`` for a variant).

    ``token_ids`` are the tokens whose KV this step computes (the scheduler hands a slice of
    the trajectory's int32 ids, an ``array('i')``), at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; ``start_pos`` tokens of KV are already
    in the cache (read through ``block_table``). ``block_table`` lists device block ids
    covering at least ``start_pos + len(token_ids)`` positions; position p lives in block
    ``block_table[p // block_size]`` at offset ``p % block_size``.

    When ``sampling`` is set, the executor samples the next token from the logits of the
    last position, with generation step index ``step`` (seeded sampling depends only on
    ``(sampling.seed, step)``). ``sample_count`` > 1 samples that many tokens from the same
    logits (used by ``n`` > 1: the prompt is prefilled once, each branch samples its own
    first token with step seeds ``seed + i``).

    ``window_table`` (hybrid models whose executor keeps a window group, `WindowExecutor`)
    lists the window group's blocks, parallel to ``block_table``: the sliding-window layers
    read and write those; entries wholly outside the window are the null block 0.

    A named tuple: one is built per running sequence per step (the scheduler calls
    ``tuple.__new__(SeqWork, fields)`` itself, skipping the generated ``__new__``), and
    executors read its fields through C getters; both cost less than a dataclass's.
    """

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sampling: SamplingParams | None = None
    step: int = 0
    seed: int = 0
    sample_count: int = 1
    window_table: Sequence[int] | None = None


@dataclass(slots=True)
class StepOutput:
    """Sampled tokens per seq_id (only for works that asked to sample).

    Not ``frozen``: a frozen dataclass's ``__init__`` costs several times a plain one's
    (``object.__setattr__`` per field), and one is built per step; read-only."""

    tokens: dict[int, list[int]]


class Executor(Protocol):
    """Runs batches against a paged KV pool of ``num_blocks`` blocks of ``block_size``.

    ``fingerprint`` names the model and its KV layout (weights identity, KV dtype, block size,
    config): the seed of every chained block hash, so cache keys that outlive the process
    (disk tier, session store, a fleet's directory) never mix models.
    """

    block_size: int
    num_blocks: int
    fingerprint: ModelFingerprint

    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        """Compute KV for every work's tokens; sample where asked."""
        ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole device blocks src -> dst (copy-on-write of a fork's partial tail)."""
        ...

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        """Overwrite freed device blocks with garbage (NaN), so a stale read shows; a test aid
        (``EngineConfig.poison_freed_blocks``). An executor without KV contents ignores it."""
        ...


@dataclass(frozen=True, slots=True)
class WindowGroupSpec:
    """An executor's sliding-window layer group: its window and its pool of blocks (of the
    same block size as the full group's; block 0 is the null block, all zeros), and what one
    block of the window layers' KV costs on the device (0: not said)."""

    window_tokens: int
    num_blocks: int
    block_bytes: int = 0


@runtime_checkable
class WindowExecutor(Protocol):
    """An executor that keeps sliding-window layers' KV in a group of its own, so the engine
    releases the blocks wholly outside the window (`kvpilot.memory.window`)."""

    window_group: WindowGroupSpec | None

    def copy_window_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """`Executor.copy_blocks` for the window group's blocks."""
        ...

    def poison_window_blocks(self, blocks: Sequence[int]) -> None:
        """`Executor.poison_blocks` for the window group's blocks."""
        ...


def window_kv_options(executor: object) -> dict[str, int]:
    """`KVConfig` fields for the executor's window group (none: no such group)."""
    spec = executor.window_group if isinstance(executor, WindowExecutor) else None
    if spec is None:
        return {}
    return {
        "window_tokens": spec.window_tokens,
        "num_window_blocks": spec.num_blocks,
        "window_block_bytes": spec.block_bytes,
    }


class Transfer(Protocol):
    """A copy in flight (a `concurrent.futures.Future` satisfies it).

    Its result is the seconds the copy took (for the bandwidth meters), or for reads of
    block bytes, the list of blocks' bytes.
    """

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class TierTransport(Protocol):
    """Moves whole KV blocks between the device pool, a host pool and bytes (for disk).

    Copies run off the step loop (a background copier on CPU, a separate stream on CUDA);
    the engine keeps the blocks involved pinned until the returned `Transfer` is done.
    """

    num_host_blocks: int
    block_bytes: int

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        """Copy device blocks to host blocks: (device, host) pairs."""
        ...

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        """Copy host blocks to device blocks: (host, device) pairs."""
        ...

    def read_device(self, blocks: Sequence[int]) -> Transfer:
        """The bytes of device blocks (result: list of bytes), e.g. to write them to disk."""
        ...

    def write_device(self, blocks: Sequence[int], data: Sequence[bytes]) -> Transfer:
        """Fill device blocks from bytes (read back from disk)."""
        ...

    def poison_host(self, blocks: Sequence[int]) -> None:
        """Overwrite freed host blocks with garbage (NaN), like `Executor.poison_blocks`."""
        ...
