"""The garbage collector during a simulation: fewer collections, same results.

CPython's cyclic collector runs a young-generation pass every ``threshold0`` net container
allocations, and every pass walks every object still young, among them the simulation's
long token lists (thousands of items each), as they pass through the generations; a full
pass walks everything, imported modules included. The simulator allocates fast and frees
almost everything by reference counting, so most of those walks find nothing.

`fewer_collections` is for the length of a run: it moves what exists at the start (modules,
the engine and workload set up) to the permanent generation, which passes skip
(`gc.freeze`, unless something froze objects before), and raises the young threshold; on
exit it restores both, what the run kept joining the oldest generation (else the restored
threshold would start a young collection at once, over everything the run kept). Cyclic
garbage made during the run is still collected (less often), so memory stays bounded;
results cannot change (nothing in the simulation depends on when a cycle is freed).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Measured on benchmarks/bench_sim.py (one simulated hour, which makes no cyclic garbage):
# 3,000 ran 4 young collections, ~50 ms of walking long token lists; 20,000 runs none.
YOUNG_THRESHOLD = 20_000


@contextmanager
def fewer_collections(young_threshold: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """Freeze what exists and collect the young generation every ``young_threshold``
    allocations until the block ends; then restore the thresholds and unfreeze."""
    if young_threshold < 1:
        raise ValueError(f"young_threshold must be positive, got {young_threshold}")
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # else someone froze before us: leave theirs be
    if freeze:
        gc.freeze()
    gc.set_threshold(max(young_threshold, thresholds[0]), *thresholds[1:])
    try:
        yield
    finally:
        if freeze:
            # What the run made and kept joins the oldest generation, as what we froze does:
            # restoring the young threshold would otherwise start a collection at the next
            # allocation that walks all of it (young since the run began). Freezing empties
            # the young generation and zeroes its count; unfreezing moves all to the oldest.
            gc.freeze()
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        else:
            gc.set_threshold(*thresholds)
