"""When a written batch is durable: one fsync covers every write completed before it.

The store's writes complete in order (one I/O thread, `kvpilot.store.staging`), numbered by
how many shares were handed out before them. A batch whose last share is number ``seq`` is
durable once an fsync has *started* after share ``seq`` completed; batches that finish while
an fsync runs share the next one, so a stream of batches pays fewer fsyncs than batches.

A failed fsync leaves unknown which completed writes reached the device (the kernel may drop
the failed pages and report the error once), so every batch whose shares completed before the
failure returned fails too, never "stored" on the strength of a later fsync that succeeds.
"""

from __future__ import annotations

import errno
from collections.abc import Callable


class SyncPoints:
    """Used from one thread only (the store's sync thread)."""

    def __init__(self, sync: Callable[[], None], completed: Callable[[], int]) -> None:
        self._sync = sync
        self._completed = completed
        self.synced = 0  # shares known durable
        self.unknown = 0  # shares completed before an fsync failed: never durable
        self.fsyncs = 0

    def make_durable(self, seq: int) -> None:
        """Returns once shares up to ``seq`` (all completed) are on stable storage; raises
        OSError when they may not be."""
        if seq <= self.unknown:
            raise OSError(errno.EIO, "an fsync after this batch was written failed")
        if seq <= self.synced:
            return
        covered = self._completed()
        self.fsyncs += 1
        try:
            self._sync()
        except OSError:
            self.unknown = max(self.unknown, self._completed())
            raise
        self.synced = max(self.synced, covered)
