"""A trajectory's high-water mark: the most KV its steps have computed, for recompute counts."""

from __future__ import annotations


class HighWaterMark:
    """The high-water mark of the KV computed by steps, kept by `Trajectory` (its base).

    ``num_computed_tokens`` is the trajectory's KV count; whatever changes it other than a
    step (a prefix hit, a release, a cut, a fork) folds the mark so far into ``_peak`` and
    sets ``_settled`` to the count right after it.
    """

    num_computed_tokens: int
    _peak: int
    _settled: int

    def high_water(self) -> int:
        """The most tokens of KV this trajectory has had computed by steps (`mark_computed`;
        a prefix hit or a fork's inherited KV is not), as capped by `cap_high_water` and
        reset by `forget_high_water`: what a recompute count compares an admission with.

        Kept without a per-step cost: a step only raises num_computed_tokens, so the count
        now was reached by a step exactly when it differs from the count right after the
        last change made otherwise (a prefix hit, a release, a cut, a fork), where the mark
        so far is folded in (``_peak``).
        """
        done = self.num_computed_tokens
        if done != self._settled and done > self._peak:
            return done
        return self._peak

    def cap_high_water(self, num_tokens: int) -> None:
        """At most ``num_tokens`` count as computed before (a rewind: what follows is new)."""
        self._peak = min(self.high_water(), num_tokens)
        self._settled = self.num_computed_tokens

    def forget_high_water(self) -> None:
        """Nothing counts as computed before (the KV computed so far is forgotten)."""
        self._peak = 0
        self._settled = self.num_computed_tokens
