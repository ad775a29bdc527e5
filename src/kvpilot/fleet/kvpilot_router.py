"""kvpilot's router: the affinity-load objective over the directory, with session affinity.

For each request:

1. Fingerprint the whole prompt with the engines' chained hash (`kvpilot.fleet.keys`;
   a growing session hashes only its new blocks).
2. Ask the `PrefixDirectory` how many leading blocks each live replica holds, by tier.
3. Score every live replica with the seed's objective (`kvpilot.fleet.scoring`).
4. A request with an affinity (its session, else its ``prompt_cache_key``) goes to that
   affinity's home replica while home is up and not overloaded; an overloaded home loses
   the turn only when the break-even rule says moving pays (`kvpilot.fleet.migration`).
   A home that died is forgotten: the request takes the best score, which becomes home.
5. Otherwise, the best score (ties: the shorter queue, then the replica's order).
"""

from __future__ import annotations

from collections import OrderedDict

from kvpilot.fleet.directory import PrefixDirectory, TierMatch
from kvpilot.fleet.keys import KeySpace, PromptKeyCache
from kvpilot.fleet.load import FleetView, ReplicaView, RouteRequest
from kvpilot.fleet.migration import decide_migration
from kvpilot.fleet.routers import RouteDecision, _Base
from kvpilot.fleet.scoring import RouterConfig, load_ratio, matched_tokens, score


class KvpilotRouter(_Base):
    name = "kvpilot"

    def __init__(
        self,
        fleet: FleetView,
        directory: PrefixDirectory | None = None,
        config: RouterConfig | None = None,
        key_space: KeySpace | None = None,
        seed: int = 0,
        max_affinities: int = 1 << 20,
    ) -> None:
        super().__init__(fleet, seed)
        self.directory = directory if directory is not None else PrefixDirectory()
        self.config = config or RouterConfig()
        self.keys = PromptKeyCache(key_space or KeySpace())
        self.max_affinities = max_affinities
        self.homes: OrderedDict[str, str] = OrderedDict()
        self.migrations = 0
        self.rehomed = 0

    def route(self, request: RouteRequest, now: float) -> RouteDecision:
        live = self.fleet.require_live()
        keys = self.keys.keys(request.tokens, request.salt, request.session)
        matches = self.directory.match(keys, [v.name for v in live])
        cfg = self.config
        n = len(request.tokens)
        scored: list[tuple[float, float, ReplicaView]] = []
        for view in live:
            m = matched_tokens(matches.get(view.name), view.load)
            scored.append((score(m, n, load_ratio(view, cfg), cfg), m, view))
        best_score, best_match, best = max(scored, key=lambda s: (s[0], -s[2].ongoing))
        affinity = request.affinity
        home_name = self.homes.get(affinity) if affinity is not None else None
        if home_name is not None:
            home = self.fleet.replicas.get(home_name)
            if home is not None and home.live:
                home_score, home_match = next((s, m) for s, m, v in scored if v is home)
                if best is home:
                    return RouteDecision(home.name, "home, best score", home_match, home_score)
                decision = decide_migration(home, home_match, best, best_match, cfg)
                if not decision.migrate:
                    return RouteDecision(
                        home.name, decision.reason, home_match, home_score, decision
                    )
                self.migrations += 1
                return RouteDecision(best.name, decision.reason, best_match, best_score, decision)
            self.rehomed += 1
            why = f"home {home_name} is down: best score"
        else:
            why = "best score"
        return RouteDecision(best.name, why, best_match, best_score)

    def use_key_space(self, space: KeySpace) -> None:
        """Hash prompts under ``space`` from now on (the engines' block size and model)."""
        self.keys = PromptKeyCache(space)

    def on_routed(self, request: RouteRequest, decision: RouteDecision, now: float) -> None:
        super().on_routed(request, decision, now)
        affinity = request.affinity
        if affinity is not None:
            self.homes[affinity] = decision.replica
            self.homes.move_to_end(affinity)
            if len(self.homes) > self.max_affinities:
                self.homes.popitem(last=False)

    def forget(self, request: RouteRequest) -> None:
        """The session closed: drop its home and its cached keys."""
        affinity = request.affinity
        if affinity is not None:
            self.homes.pop(affinity, None)
        if request.session is not None:
            self.keys.forget(request.session)

    def on_replica_removed(self, replica: str) -> None:
        self.directory.remove_replica(replica)

    def match(self, request: RouteRequest) -> dict[str, TierMatch]:
        """What the directory knows of this prompt, per replica (for reports and tests)."""
        keys = self.keys.space.keys(request.tokens, request.salt)
        return self.directory.match(keys)
