"""Ray Serve LLM's ``PrefixCacheAffinityRouter``, re-implemented (labelled ``ray_prefix``).

Ray's own class cannot be imported here: ``ray.serve.llm`` needs ``ray[llm]`` (pyarrow and
vLLM, a GPU stack), and it is a Ray Serve request router that needs a running cluster, so
it could not run on the simulator's virtual time either. This is its documented algorithm
(Ray Serve docs, "Prefix-aware routing", and its source, read for reference), with its
defaults:

1. Queue lengths (requests in flight) of every candidate; if max - min exceeds
   ``imbalanced_threshold`` (10), fall back to power of two choices.
2. Otherwise match the prompt against a prefix tree of what the router itself sent, by
   character (an approximate radix tree with one set of "tenants", the replicas, per node).
   If the matched fraction is at least ``match_rate_threshold`` (0.1), the candidates are
   the replicas owning the deepest matched node; below it, the replicas with the fewest
   characters in the tree ("smallest tenants").
3. Among the candidates, the one with the shortest queue.
4. After routing, the whole prompt is inserted for the chosen replica.

Eviction is off, as in Ray's default (``do_eviction=False``). Where no prompt text is
given (the simulator), the prompt's token ids stand in for characters (4 per token), which
leaves every match fraction unchanged.
"""

from __future__ import annotations

from array import array

from kvpilot.fleet.load import FleetView, ReplicaView, RouteRequest
from kvpilot.fleet.routers import RouteDecision, _Base


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: set[str] = set()


class PrefixTree:
    """Multi-tenant character prefix tree (no eviction)."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.chars: dict[str, int] = {}

    def add_tenant(self, tenant: str) -> None:
        if tenant not in self.chars:
            self.chars[tenant] = 0
            self.root.tenants.add(tenant)

    def insert(self, text: str, tenant: str) -> None:
        self.add_tenant(tenant)
        node = self.root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            shared = common_prefix_len(child.text, text, i)
            if shared < len(child.text):
                upper = _Node(child.text[:shared], node)
                upper.tenants = set(child.tenants)
                node.children[text[i]] = upper
                child.text = child.text[shared:]
                child.parent = upper
                upper.children[child.text[0]] = child
                child = upper
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                self.chars[tenant] += len(child.text)
            node = child
            i += shared

    def prefix_match(self, text: str, tenants: set[str]) -> tuple[int, set[str]]:
        """(characters matched, tenants owning the deepest matched node among ``tenants``)."""
        node = self.root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or not (child.tenants & tenants):
                break
            shared = common_prefix_len(child.text, text, i)
            i += shared
            node = child
            if shared < len(child.text):
                break
        return i, node.tenants & tenants

    def smallest_tenants(self) -> set[str]:
        if not self.chars:
            return set()
        low = min(self.chars.values())
        return {t for t, n in self.chars.items() if n == low}

    def remove_tenant(self, tenant: str) -> None:
        if self.chars.pop(tenant, None) is None:
            return
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.discard(tenant)
            for key, child in list(node.children.items()):
                if child.tenants == {tenant}:
                    del node.children[key]
                else:
                    stack.append(child)


def common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]`` (bisection on C-level
    slice comparisons: long prompts share long prefixes)."""
    n = min(len(edge), len(text) - start)
    if text.startswith(edge[:n], start):
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[lo:mid], start + lo):
            lo = mid
        else:
            hi = mid
    return lo


def prompt_text(request: RouteRequest) -> str:
    if request.text is not None:
        return request.text
    return array("i", request.tokens).tobytes().decode("latin-1")


class RayPrefixRouter(_Base):
    name = "ray_prefix"

    def __init__(
        self,
        fleet: FleetView,
        seed: int = 0,
        imbalanced_threshold: int = 10,
        match_rate_threshold: float = 0.1,
    ) -> None:
        super().__init__(fleet, seed)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = PrefixTree()

    def route(self, request: RouteRequest, now: float) -> RouteDecision:
        live = self.fleet.require_live()
        for view in live:
            self.tree.add_tenant(view.name)
        queues = [v.ongoing for v in live]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            return self._pow2(live, "load imbalanced: power of two")
        text = prompt_text(request)
        names = {v.name for v in live}
        matched, owners = self.tree.prefix_match(text, names)
        rate = matched / len(text) if text else 0.0
        if rate < self.match_rate_threshold:
            chosen = self.tree.smallest_tenants() & names
            why = f"match {rate:.0%} < {self.match_rate_threshold:.0%}: smallest tenant"
        else:
            chosen = owners
            why = f"prefix match {rate:.0%}"
        if not chosen:
            return self._pow2(live, "no prefix data: power of two")
        view = self._least_ongoing([self.fleet[name] for name in sorted(chosen)])
        return RouteDecision(view.name, why)

    def _pow2(self, live: list[ReplicaView], why: str) -> RouteDecision:
        pair = self.rng.sample(live, min(2, len(live)))
        return RouteDecision(self._least_ongoing(pair).name, why)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        super().on_routed(request, decision, now)
        self.tree.insert(prompt_text(request), decision.replica)

    def on_replica_removed(self, replica: str) -> None:
        self.tree.remove_tenant(replica)
