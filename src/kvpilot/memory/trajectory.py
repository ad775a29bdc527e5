"""An agent session's KV state: its tokens, the radix path it locks, and its private blocks."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvpilot.errors import InvalidRequest, OutOfBlocks
from kvpilot.memory.block_pool import BlockPool
from kvpilot.memory.hashing import root_hash
from kvpilot.memory.radix import RadixCache, RadixNode, as_token_array
from kvpilot.memory.trajectory_check import check_trajectory
from kvpilot.memory.trajectory_marks import HighWaterMark
from kvpilot.memory.trajectory_prefix import adopt_cached_prefix, truncate_trajectory
from kvpilot.memory.window import WindowPool
from kvpilot.memory.window_table import WindowTable


class TrajectoryRegistry(Protocol):
    """What a trajectory needs from its owner (the `KVManager`): the device pool and radix it
    holds blocks in, and a register of open trajectories (a fork registers its child)."""

    radix: RadixCache
    device: BlockPool
    block_size: int
    window: WindowPool | None  # the sliding-window layer group, for hybrid models
    model_digest: bytes
    # Registered trajectories whose table holds a block: a trajectory counts itself in and
    # out where its table turns non-empty or empty (the registry counts a fork's child).
    resident_trajectories: int

    def next_trajectory_id(self) -> int: ...

    def register(self, traj: Trajectory) -> None: ...

    def deregister(self, traj: Trajectory) -> None: ...


@dataclass(frozen=True, slots=True)
class ForkResult:
    """A fork's child, the (src, dst) block copy its partial tail needs, and whether it was
    deferred (opened on the parent's tokens with no KV: it recomputes its tail from the cache)."""

    child: Trajectory
    copy: tuple[int, int] | None
    deferred: bool = False
    window_copy: tuple[int, int] | None = None  # the same copy in the window group


class Trajectory(HighWaterMark):
    """An agent session's KV state. Tokens are the truth; KV is derivative.

    ``block_table[i]`` holds KV of positions ``[i*B, (i+1)*B)``. The first
    ``locked_tokens // B`` entries are the blocks of the radix path it locks (shared); the
    rest are private. The trajectory holds one reference on each private block and one lock on
    ``locked_node`` (a root when nothing is cached) while open. The lock is its hold on the
    shared blocks: a locked path is never evicted, and the tree's references keep its blocks,
    so adopting, forking or releasing a cached prefix touches no refcount per block::

        block_table: [ 7 | 3 | 12 | 1 | 9 ]      B = 4, num_computed_tokens = 18
                      \\__ locked path __/ \\_ private partial tail (2 of 4 slots valid)

    ``tokens`` is one int32 ``array('i')``, never a
    list: a prompt of a million ids stays a memcpy, not a million Python ints. Read it with
    ``len``, indexing and slicing; extend it with ``append_token(s)`` (or in place); compare
    it with another array, or ``tolist()`` it first (an array never equals a list).
    """

    def __init__(
        self,
        manager: TrajectoryRegistry,
        traj_id: int,
        salt: str | None = None,
        tokens: Iterable[int] = (),
    ) -> None:
        self._manager = manager
        self._radix = manager.radix
        self._pool = manager.device
        self._bs = manager.block_size
        self.traj_id = traj_id
        self.salt = salt
        self.tokens: array = array("i")
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # The high-water mark of the KV computed by steps (`high_water`): the mark as of the
        # last change to num_computed_tokens not made by a step, and the count right after it.
        self._peak = 0
        self._settled = 0
        self.prompt_tokens_total = 0
        self.hit_tokens_total = 0
        # Reuse at most this many cached tokens (prompt caching with breakpoints: a prefix
        # is read only where a breakpoint pinned it). None: the longest cached prefix.
        self.reuse_limit: int | None = None
        self.closed = False
        # Hybrid models: the sliding-window group's table, parallel to block_table.
        self.window: WindowTable | None = None
        if manager.window is not None:
            self.window = WindowTable(manager.window, root_hash(salt, manager.model_digest))
        # Kept in step with locked_node and block_table (read on every step; the locked node
        # changes depth only through this trajectory's own commits, see `_recount`).
        self.locked_tokens = 0
        self.num_private_blocks = 0
        # Set by the idle-held tally (`engine.idle_held`) while the trajectory is idle: it
        # appends itself whenever its locked node or its table's length changes.
        self.held_log: list[Trajectory] | None = None
        self.append_tokens(tokens)
        self.locked_node: RadixNode = self._radix.root(salt)
        self._radix.lock(self.locked_node)

    # ---- state ---------------------------------------------------------------------------

    @property
    def radix(self) -> RadixCache:
        """The prefix cache this trajectory's path is locked in."""
        return self._radix

    @property
    def hit_rate(self) -> float:
        """Equation 2 over this trajectory's turns."""
        return self.hit_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def __repr__(self) -> str:
        return (
            f"Trajectory(id={self.traj_id}, salt={self.salt!r}, tokens={len(self.tokens)}, "
            f"computed={self.num_computed_tokens}, locked={self.locked_tokens}, "
            f"blocks={len(self.block_table)}, closed={self.closed})"
        )

    def _require_open(self) -> None:
        if self.closed:
            raise InvalidRequest(f"trajectory {self.traj_id} is closed; open a new one")

    def _lock_to(self, node: RadixNode) -> None:
        old = self.locked_node
        if node is not old:
            self._radix.relock(old, node)
            self.locked_node = node
        self._recount()

    def _recount(self) -> None:
        """Set ``locked_tokens`` and ``num_private_blocks`` from the locked node and the table.

        Every change to either goes through this trajectory: the locked node's depth moves
        only with its own `commit` (`extend_leaf` needs the node's only lock; splits keep
        the deeper node's identity and depth; a locked node is never trimmed), so the hot
        paths (`allocate`, `commit`) update both by what they add, the others call this.
        """
        self.locked_tokens = self.locked_node.depth_tokens
        self.num_private_blocks = len(self.block_table) - self.locked_tokens // self._bs
        if self.held_log is not None:
            self.held_log.append(self)

    # ---- turns ---------------------------------------------------------------------------

    def token_array(self) -> array:
        """The tokens as int32: ``tokens`` itself."""
        return self.tokens

    def append_token(self, token: int) -> None:
        """One sampled token (the decode hot path)."""
        if self.closed:
            self._require_open()
        self.tokens.append(token)

    def append_tokens(self, tokens: Iterable[int], ids: array | None = None) -> None:
        """Append ``tokens`` (an int32 array is copied in as it is); ``ids``: the same tokens
        already as int32, for a caller that holds both (``tokens`` is then not read)."""
        if self.closed:
            self._require_open()
        self.tokens.extend(as_token_array(tokens) if ids is None else ids)

    def reuse_prefix(self, *, record: bool = True) -> int:
        """Adopt the longest cached prefix; returns num_computed_tokens (the cached tokens).

        ``record=False`` leaves the hit statistics alone (a retry of the same admission).
        """
        self._require_open()
        n = len(self.tokens)
        end = max(n - 1, 0) if self.reuse_limit is None else min(max(n - 1, 0), self.reuse_limit)
        # The usual case, a session's next turn: its locked node is a leaf, so the match would
        # end there, at or below what it has computed; only the path's access times change.
        if not self._radix.touch_leaf(self.locked_node, end):
            adopt_cached_prefix(self, end)  # trajectory_prefix.py
        if record:
            self.prompt_tokens_total += n
            self.hit_tokens_total += self.num_computed_tokens
            stats = self._radix.stats
            stats.queried_tokens += n
            stats.hit_tokens += self.num_computed_tokens
        return self.num_computed_tokens

    def blocks_needed(self, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        covered = -(-(self.num_computed_tokens + num_new_tokens) // self._bs)
        return max(0, covered - len(self.block_table))

    def allocate(self, num_new_tokens: int) -> None:
        if self.closed:
            self._require_open()
        if num_new_tokens < 0:
            self.blocks_needed(num_new_tokens)  # raises
        # blocks_needed, inline (the decode hot path)
        need = -(-(self.num_computed_tokens + num_new_tokens) // self._bs) - len(self.block_table)
        if need <= 0:
            return
        window = self.window
        if need == 1 and window is None:  # a decode step's block (the hot path)
            self.take_block()
            return
        if self.held_log is not None:  # an idle trajectory taking blocks (a prefetch, a test)
            self.held_log.append(self)
        pool = self._pool
        if window is None:
            free = pool._free
            if need > len(free):  # a full pool: `evict` then `allocate` as one call
                blocks = self._radix.evict_and_allocate(need)
                if blocks is None:  # more than one trim: the pair
                    self._radix.evict(need - len(free))
                    blocks = pool.allocate(need)
                self.block_table += blocks
            else:
                self.block_table += pool.allocate(need)
            self.num_private_blocks += need
            if len(self.block_table) == need:  # it was empty: now resident
                self._manager.resident_trajectories += 1
            return
        fresh = window.pool.allocate(need)  # a hybrid model's window blocks first
        try:
            if pool.num_free < need:
                self._radix.evict(need - pool.num_free)
            self.block_table.extend(pool.allocate(need))
        except OutOfBlocks:
            window.pool.release(fresh)
            raise
        self.num_private_blocks += need
        if len(self.block_table) == need:  # it was empty: now resident
            self._manager.resident_trajectories += 1
        window.grow(fresh)

    def extend_run(self, ids: array, computed: int) -> None:
        """A decode run's tokens: ``ids`` (int32) appended and the KV counted as computed up
        to ``computed``, as at the run's end, at once. The run then takes the blocks of its
        steps (`take_block`) and commits (`commit` with ``upto``) in step order: until its
        last block is taken the table covers less than that count, and a look inside the run
        sets the count of its step first (`computed_in_run`)."""
        if self.closed:
            self._require_open()
        tokens = self.tokens
        if computed > len(tokens) + len(ids) or computed < self.num_computed_tokens:
            self._reject_computed(computed - self.num_computed_tokens)  # before any change
        tokens += ids
        self.num_computed_tokens = computed

    def computed_in_run(self, computed: int) -> None:
        """The KV computed as of a step inside a decode run (after `extend_run`): what the
        engine shows at that step, blocks taken and commits made up to it."""
        if computed > len(self.tokens) or computed > len(self.block_table) * self._bs:
            self._reject_computed(computed - self.num_computed_tokens)
        self.num_computed_tokens = computed

    def take_block(self) -> None:
        """One more private block at the end of the table: `allocate` of a step whose tokens
        cross into a new block (a decode step's), for a trajectory without a window table. A
        decode run (`kvpilot.engine.decode_run`) calls it at each step where a sequence
        crosses a block boundary, in step order."""
        if self.held_log is not None:  # an idle trajectory taking blocks (a prefetch, a test)
            self.held_log.append(self)
        pool = self._pool
        free = pool._free
        if free:  # `pool.allocate(1)`, inline: the LIFO free list's last block
            block = free.pop()
            pool._refcounts[block] = 1
        else:  # a full pool: `evict(1)` then `allocate(1)` as one call
            block = self._radix.evict_one_for_reuse()
            if block < 0:
                self._radix.evict(1)
                block = pool.allocate(1)[0]
        table = self.block_table
        table.append(block)
        self.num_private_blocks += 1
        if len(table) == 1:  # it was empty: now resident
            self._manager.resident_trajectories += 1

    def mark_computed(self, n: int) -> None:
        if self.closed:
            self._require_open()
        done = self.num_computed_tokens + n
        if n < 0 or done > len(self.tokens) or done > len(self.block_table) * self._bs:
            self._reject_computed(n)
        self.num_computed_tokens = done
        if self.window is not None:
            self.window.slide(done, self.tokens)

    def _reject_computed(self, n: int) -> None:
        done = self.num_computed_tokens + n
        if n < 0 or done > len(self.tokens):
            raise ValueError(
                f"trajectory {self.traj_id}: cannot mark {n} tokens computed "
                f"({self.num_computed_tokens} computed of {len(self.tokens)} tokens)"
            )
        raise ValueError(
            f"trajectory {self.traj_id}: {done} computed tokens need "
            f"{-(-done // self._bs)} blocks, table has {len(self.block_table)}; allocate first"
        )

    def commit(self, upto: int | None = None) -> int:
        """Hand the full blocks of the KV computed (of its first ``upto`` tokens, where
        given: a decode run's commit at a step before the run's end) to the prefix cache;
        returns the blocks newly cached."""
        if self.closed:
            self._require_open()
        bs = self._bs
        n_full = (self.num_computed_tokens if upto is None else upto) // bs
        shared = self.locked_tokens // bs
        if n_full <= shared:
            return 0
        table = self.block_table
        tokens = self.tokens[shared * bs : n_full * bs]
        if self._radix.grow_leaf(self.locked_node, tokens, table[shared:n_full]):
            # Not for `held_log`: the blocks move from the private tail to the leaf only this
            # trajectory locks, so the blocks it holds alone stay the same.
            self.locked_tokens = n_full * bs  # the locked leaf now ends at n_full blocks
            self.num_private_blocks -= n_full - shared
            return n_full - shared
        own = table[shared:n_full]
        result = self._radix.insert_below(self.locked_node, tokens, own)
        if result.blocks != own:  # some blocks were cached already: use those instead
            table[shared:n_full] = result.blocks
        self._lock_to(result.node)
        # The lock now holds the path: drop the private references (the tree took its own on
        # the blocks it kept; the duplicates of cached blocks go back to the pool).
        self._pool.decref_many(own)
        self.num_private_blocks = len(table) - n_full
        return result.num_new_blocks

    def finish_turn(self) -> None:
        self.commit()

    def fork(self) -> ForkResult:
        """Figure 5: the child shares every full block and gets its own copy of the partial tail."""
        self._require_open()
        self.commit()
        n_full, tail = divmod(self.num_computed_tokens, self._bs)
        pool = self._pool
        window = self.window
        dst: int | None = None
        window_dst: int | None = None
        if tail:
            if window is not None:
                window_dst = window.pool.allocate(1)[0]
            try:
                if pool.num_free < 1:
                    self._radix.evict(1)
                dst = pool.allocate(1)[0]
            except OutOfBlocks:
                if window is not None and window_dst is not None:
                    window.pool.release([window_dst])
                raise
        manager = self._manager
        child = Trajectory(manager, manager.next_trajectory_id(), self.salt, self.tokens)
        shared = self.block_table[:n_full]  # the parent's locked path (committed just now)
        child.block_table = shared if dst is None else [*shared, dst]
        child._lock_to(self.locked_node)  # and counts its blocks
        child.num_computed_tokens = child._settled = self.num_computed_tokens  # not by a step
        window_copy = None
        if window is not None:
            child.window = window.forked(n_full, window_dst)
            if window_dst is not None:
                window_copy = (window.blocks[n_full], window_dst)
        manager.register(child)
        copy = None if dst is None else (self.block_table[n_full], dst)
        return ForkResult(child, copy, window_copy=window_copy)

    def release_kv(self, keep_in_cache: bool = True) -> None:
        self._require_open()
        if keep_in_cache:
            self.commit()
        if self.window is not None:
            self.window.release_all(self.num_computed_tokens, self.tokens, publish=keep_in_cache)
        private = self.block_table[self.locked_tokens // self._bs :]
        if self.block_table:
            self._manager.resident_trajectories -= 1
        self.block_table = []
        self._peak = self.high_water()
        self.num_computed_tokens = self._settled = 0
        self._lock_to(self._radix.root(self.salt))
        self._pool.decref_many(private)

    def truncate(self, num_tokens: int) -> None:
        """Rewind to the first ``num_tokens`` tokens (a client resent a history that diverged;
        `kvpilot.memory.trajectory_prefix.truncate_trajectory`)."""
        truncate_trajectory(self, num_tokens)

    def close(self) -> None:
        if self.closed:
            return
        self.release_kv(keep_in_cache=True)
        self._radix.unlock(self.locked_node)
        self.closed = True
        self._manager.deregister(self)

    # ---- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        check_trajectory(self)  # trajectory_check.py
