"""Looking up the radix cache: `match` (refreshes access times, splits where a prefix ends
inside an edge), `touch_leaf` (a session's next turn, when the match would end at its locked
leaf) and `peek` (looks without touching)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from kvpilot.memory.radix_node import MatchResult, PeekResult, RadixNode, RadixStats, as_token_array
from kvpilot.memory.tiers import Tier


class RadixLookup(ABC):
    """`RadixCache`'s lookups (a base class; the cache's fields it reads are declared here for
    the type checker)."""

    block_size: int
    stats: RadixStats
    _roots: dict[str | None, RadixNode]
    _clock: Callable[[], float]

    @abstractmethod
    def root(self, salt: str | None = None) -> RadixNode:
        """The root of ``salt``'s tree (created on first use)."""

    @abstractmethod
    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` blocks; the new upper node is returned."""

    def match(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        *,
        record: bool = True,
        tier: Tier | None = Tier.DEVICE,
        below: RadixNode | None = None,
        length: int | None = None,
    ) -> MatchResult:
        """The longest cached block-aligned prefix of ``tokens`` whose every block has a copy in
        ``tier`` (any tier if None), its nodes' access times refreshed (splitting the last one
        where the prefix ends inside its edge).

        ``below``: a node whose path is a prefix of ``tokens`` (a trajectory's locked node):
        its path is taken without comparing tokens, with the same result. ``length``: look at
        the first ``length`` tokens only, as `match` of ``tokens[:length]`` would (no copy)."""
        arr = as_token_array(tokens)
        n = len(arr) if length is None else max(0, min(length, len(arr)))
        bs = self.block_size
        node = self.root(salt)
        size = n // bs * bs  # the block-aligned tokens a match can cover
        step = 4 * bs
        now = self._clock()
        path = self._path_to(below, node, tier, size) if below is not None else []
        for known in path:
            known.last_access = now
        if path:
            node = path[-1]
        base = node.depth_tokens  # covered by the path taken from ``below``
        with memoryview(arr) as view:  # only the tokens past it are compared: copy just those
            query = view[base:size].tobytes()
        end = len(query)
        offset = 0  # bytes of ``query`` matched
        while offset < end:  # hot path
            child = node.children.get(query[offset : offset + step])
            if child is None or (tier is not None and tier not in child.blocks):
                break
            edge = child.tokens
            if offset + 4 * len(edge) <= end and query.startswith(edge, offset, end):
                k = len(edge) // bs
            else:
                k = self._common_blocks(edge, query, offset, end)
                if k < len(edge) // bs:
                    child = self._split(child, k)
            child.last_access = now
            path.append(child)
            node = child
            offset += k * step
            if k * bs < len(edge):
                break
        num_tokens = base + offset // 4
        if record:
            self.stats.queried_tokens += n
            self.stats.hit_tokens += num_tokens
        return MatchResult(node, num_tokens, path)

    def touch_leaf(self, node: RadixNode, length: int) -> bool:
        """`match` of tokens that continue ``node``'s path, ``below=node``, ``length=length``,
        where it can only end at ``node`` (the hot path: a session's next turn): a locked leaf
        whose path fits in ``length`` tokens. Then it does what that match does, refresh the
        access time of every node on the path (its nodes hold device copies: a locked path
        keeps them), and says True; otherwise it changes nothing and says False (use `match`).
        """
        if node.children or not node.lock_count or node.depth_tokens > length:
            return False  # depths are whole blocks: within ``length`` is within its blocks
        now = self._clock()
        while node.parent is not None:  # `_path_to`'s walk, to the root (excluded)
            node.last_access = now
            node = node.parent
        return True

    @staticmethod
    def _path_to(
        node: RadixNode, root: RadixNode, tier: Tier | None, max_tokens: int
    ) -> list[RadixNode]:
        """The nodes from ``root`` (excluded) down to ``node``, if a match of at least its
        depth walks them all (each holds a copy in ``tier``); else none (the match walks)."""
        if node.depth_tokens > max_tokens or not node._alive:
            return []
        path: list[RadixNode] = []
        while node.parent is not None:
            if tier is not None and tier not in node.blocks:
                return []
            path.append(node)
            node = node.parent
        if node is not root:
            return []
        path.reverse()
        return path

    def peek(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        *,
        below: RadixNode | None = None,
        length: int | None = None,
    ) -> PeekResult:
        """Look without touching: the longest cached prefix of ``tokens`` in any tier, and per
        tier how many of its blocks have a copy there. Unlike `match` it refreshes no LRU
        time, splits no node and counts toward no statistics, so looking (e.g. to report a
        session's residency) never changes what gets evicted. ``below`` and ``length``: as
        for `match`."""
        counts = dict.fromkeys(Tier, 0)
        node = self._roots.get(salt)
        if node is None:
            return PeekResult(0, counts)
        arr = as_token_array(tokens)
        n = len(arr) if length is None else max(0, min(length, len(arr)))
        bs = self.block_size
        size = n // bs * bs  # the block-aligned tokens a match can cover
        if below is not None:
            for known in self._path_to(below, node, None, size):
                for tier in known.blocks:
                    counts[tier] += known.num_blocks
                node = known
        base = node.depth_tokens  # covered by the path taken from ``below``
        if not node.children or base >= size:  # nothing past it to compare: no copy
            return PeekResult(base, counts)
        with memoryview(arr) as view:  # only the tokens past it are compared: copy just those
            query = view[base:size].tobytes()
        end = len(query)
        step = 4 * bs
        offset = 0  # bytes of ``query`` matched
        while offset < end:
            child = node.children.get(query[offset : offset + step])
            if child is None:
                break
            edge = child.tokens
            if offset + 4 * len(edge) <= end and query.startswith(edge, offset, end):
                k = len(edge) // bs
            else:
                k = self._common_blocks(edge, query, offset, end)
            for tier in child.blocks:
                counts[tier] += k
            offset += k * step
            if k * bs < len(edge):
                break
            node = child
        return PeekResult(base + offset // 4, counts)

    def _common_blocks(self, edge: array, query: bytes, offset: int, end: int) -> int:
        n = min(len(edge), (end - offset) // 4)
        a = np.frombuffer(edge, dtype=np.int32, count=n)
        b = np.frombuffer(query, dtype=np.int32, count=n, offset=offset)
        diff = np.flatnonzero(a != b)
        first = int(diff[0]) if diff.size else n
        return first // self.block_size
