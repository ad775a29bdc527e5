"""A torch-free executor whose "KV" is the token itself, for testing the scheduler and memory.

Each slot stores (token, position). Sampling reads the whole context back through the
block table, checks every position landed where it should, and derives the next token
from the tokens read. Any wrong block, stale slot or bad copy changes the output, so
comparing with `oracle_generate` (computed from the token list alone) checks every cache
decision end to end. Freed blocks are poisoned (position -1) when the engine asks, so a
stale block that still held the right tokens is caught too.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from kvpilot.engine.executor import SeqWork, StepOutput
from kvpilot.engine.sampling import SamplingParams
from kvpilot.memory import ModelFingerprint

VOCAB = 500


def next_token(context: Sequence[int], seed: int, step: int, params: SamplingParams) -> int:
    data = np.asarray(context, dtype=np.int64).tobytes()
    h = zlib.crc32(data)
    if not params.greedy:
        h = zlib.crc32(np.asarray([seed, step], dtype=np.int64).tobytes(), h)
    return h % VOCAB


def oracle_generate(
    prompt: Sequence[int], params: SamplingParams, seed: int = 0, eos: int | None = None
) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for step in range(params.max_tokens):
        t = next_token(tokens, seed, step, params)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (eos is not None and t == eos):
            break
    return out


POISON = -1


class FakeExecutor:
    fingerprint = ModelFingerprint.of("fake executor: the KV is the token")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        self.tokens = np.full(slots, -1, dtype=np.int64)
        self.positions = np.full(slots, -1, dtype=np.int64)
        self.steps: list[list[SeqWork]] = []
        self.copies: list[tuple[int, int]] = []
        self.poisoned = 0

    def _slot(self, table: Sequence[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, works: Sequence[SeqWork]) -> StepOutput:
        self.steps.append(list(works))
        out: dict[int, list[int]] = {}
        for w in works:
            for i, t in enumerate(w.token_ids):
                slot = self._slot(w.block_table, w.start_pos + i)
                self.tokens[slot] = t
                self.positions[slot] = w.start_pos + i
            if w.sampling is None:
                continue
            ctx = w.start_pos + len(w.token_ids)
            slots = [self._slot(w.block_table, p) for p in range(ctx)]
            got = self.positions[slots]
            assert (got == np.arange(ctx)).all(), f"seq {w.seq_id}: KV positions corrupted"
            context = self.tokens[slots].tolist()
            out[w.seq_id] = [
                next_token(context, w.seed + j, w.step, w.sampling) for j in range(w.sample_count)
            ]
        return StepOutput(out)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        b = self.block_size
        for src, dst in pairs:
            self.copies.append((src, dst))
            self.tokens[dst * b : (dst + 1) * b] = self.tokens[src * b : (src + 1) * b]
            self.positions[dst * b : (dst + 1) * b] = self.positions[src * b : (src + 1) * b]

    def poison_blocks(self, blocks: Sequence[int]) -> None:
        b = self.block_size
        for block in blocks:
            self.tokens[block * b : (block + 1) * b] = POISON
            self.positions[block * b : (block + 1) * b] = POISON
        self.poisoned += len(blocks)
