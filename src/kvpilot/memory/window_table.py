"""A trajectory's window-group block table (see `kvpilot.memory.window` for the design).

``blocks[i]`` is the window-group block of positions ``[i*B, (i+1)*B)``, parallel to the
trajectory's (full-group) block table: the null block for ``i < lo``, held (one reference
each) for ``i >= lo``, where ``lo = first_needed(num_computed_tokens)`` once the trajectory
has slid. ``hashes[i]`` is block i's chained hash (computed on first use, from the tokens).
"""

from __future__ import annotations

from array import array

from kvpilot.errors import require
from kvpilot.memory.hashing import block_hash
from kvpilot.memory.window import NULL_BLOCK, WindowPool, max_held_blocks


class WindowTable:
    __slots__ = ("blocks", "hashes", "lo", "pool", "root")

    def __init__(self, pool: WindowPool, root: bytes) -> None:
        self.pool = pool
        self.root = root  # the chain's seed: root_hash(salt, model)
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.lo = 0

    @property
    def num_held(self) -> int:
        return len(self.blocks) - self.lo

    def hash_of(self, i: int, tokens: array) -> bytes:
        """Block i's chained hash (block i must be full in ``tokens``)."""
        hashes = self.hashes
        bs = self.pool.block_size
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(block_hash(hashes[-1] if j else self.root, tokens[j * bs : (j + 1) * bs]))
        return hashes[i]

    def forget_hashes(self, n_blocks: int) -> None:
        """The tokens from block ``n_blocks`` on may change (a truncate): drop their hashes."""
        del self.hashes[n_blocks:]

    def grow(self, blocks: list[int]) -> None:
        self.blocks.extend(blocks)

    def slide(self, pos: int, tokens: array) -> None:
        """Release (publish, then drop) every held block wholly outside the window of ``pos``."""
        new_lo = min(self.pool.first_needed(pos), len(self.blocks))
        if new_lo <= self.lo:
            return
        pool = self.pool
        blocks = self.blocks
        for i in range(self.lo, new_lo):
            pool.publish(self.hash_of(i, tokens), blocks[i])
        pool.release(blocks[self.lo : new_lo])
        blocks[self.lo : new_lo] = [NULL_BLOCK] * (new_lo - self.lo)
        self.lo = new_lo

    def release_all(self, computed: int, tokens: array, *, publish: bool) -> None:
        """Drop every block; with ``publish``, full computed ones stay cached first."""
        pool = self.pool
        if publish:
            n_full = min(computed // pool.block_size, len(self.blocks))
            for i in range(self.lo, n_full):
                pool.publish(self.hash_of(i, tokens), self.blocks[i])
        pool.release(self.blocks[self.lo :])
        self.blocks = []
        self.lo = 0

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` entries (and hashes), dropping the rest."""
        self.pool.release(self.blocks[max(keep, self.lo) :])
        del self.blocks[keep:]
        del self.hashes[keep:]
        self.lo = min(self.lo, keep)

    def _available(self, i: int, computed: int, tokens: array) -> int | None:
        """Window KV of block i: the trajectory's own (if computed) or the cache's."""
        own = i < len(self.blocks) and self.blocks[i] != NULL_BLOCK
        if own and (i + 1) * self.pool.block_size <= computed:
            return self.blocks[i]
        return self.pool.lookup(self.hash_of(i, tokens))

    def longest_valid(self, k: int, computed: int, tokens: array) -> int:
        """The most blocks ``k' <= k`` whose window (blocks first_needed(k'B) .. k'-1) has KV."""
        bs = self.pool.block_size
        for end in range(k, 0, -1):
            start = self.pool.first_needed(end * bs)
            if all(self._available(i, computed, tokens) is not None for i in range(start, end)):
                return end
        return 0

    def adopt(self, k: int, computed: int, tokens: array) -> None:
        """Make blocks ``first_needed(kB) .. k-1`` hold their window KV (own or cached; the
        caller checked with `longest_valid`) and null out those below, for a hit at kB."""
        pool = self.pool
        lo = pool.first_needed(k * pool.block_size)
        blocks = self.blocks
        if len(blocks) < k:
            blocks.extend([NULL_BLOCK] * (k - len(blocks)))
        for i in range(lo, k):
            own = blocks[i] != NULL_BLOCK and (i + 1) * pool.block_size <= computed
            if own:
                continue
            cached = pool.lookup(self.hash_of(i, tokens))
            assert cached is not None, "adopt() after longest_valid() said it is cached"
            pool.pool.incref(cached)
            if blocks[i] != NULL_BLOCK and i >= self.lo:
                pool.release([blocks[i]])
            blocks[i] = cached
            pool.hits += 1
        if lo > self.lo:
            # Blocks now below the window: publish the computed ones, drop all.
            for i in range(self.lo, lo):
                if blocks[i] != NULL_BLOCK and (i + 1) * pool.block_size <= computed:
                    pool.publish(self.hash_of(i, tokens), blocks[i])
            pool.release(blocks[self.lo : lo])
            blocks[self.lo : lo] = [NULL_BLOCK] * (lo - self.lo)
        self.lo = lo

    def forked(self, n_full: int, tail: int | None) -> WindowTable:
        """The child's table: shares blocks ``< n_full`` (one more reference each), plus its
        own ``tail`` block (the copy of the partial block) when there is one."""
        child = WindowTable(self.pool, self.root)
        shared = self.blocks[:n_full]
        held = [b for b in shared if b != NULL_BLOCK]
        if held:
            self.pool.pool.incref_many(held)
        child.blocks = shared if tail is None else [*shared, tail]
        child.hashes = self.hashes[:n_full]
        child.lo = min(self.lo, n_full)
        return child

    def check(self, traj_id: int, computed: int, table_len: int) -> None:
        pool = self.pool
        bs = pool.block_size
        blocks = self.blocks
        require(
            len(blocks) == table_len,
            f"trajectory {traj_id}: window table has {len(blocks)} entries, block table "
            f"{table_len}",
        )
        require(
            self.lo == min(pool.first_needed(computed), table_len),
            f"trajectory {traj_id}: window starts at block {self.lo}, position {computed} "
            f"needs it at {pool.first_needed(computed)}",
        )
        require(
            all(b == NULL_BLOCK for b in blocks[: self.lo]),
            f"trajectory {traj_id}: holds a window block outside its window",
        )
        require(
            all(b != NULL_BLOCK for b in blocks[self.lo :]),
            f"trajectory {traj_id}: a null window block inside its window",
        )
        held = blocks[self.lo :]
        require(len(set(held)) == len(held), f"trajectory {traj_id}: a window block twice")
        computed_held = max(0, -(-computed // bs) - self.lo)
        require(
            computed_held <= max_held_blocks(pool.window, bs),
            f"trajectory {traj_id}: holds {computed_held} window blocks of computed KV, "
            f"more than ceil(W/B)+1 = {max_held_blocks(pool.window, bs)}",
        )
