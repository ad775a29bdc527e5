"""`kvpilot serve`'s start-up banner: every loading step, then what is served, in order."""

from __future__ import annotations

import logging

import pytest

from kvpilot.server.banner import StartupBanner


def test_weights_load_with_progress_in_quarters_when_no_terminal_shows_a_bar(
    caplog: pytest.LogCaptureFixture,
) -> None:
    banner = StartupBanner(logging.getLogger("test.banner"), bar=False)
    with caplog.at_level(logging.INFO, logger="test.banner"):
        banner.step("tokenizer")
        banner.step("weights")
        total = 13_100_000
        for done in range(0, total + 1, total // 20):
            banner.weights(done, total)
        banner.weights(total, total)  # the loader's closing report is not a second "loaded"
        banner.step("kv_pool")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:5] == [
        "loading the tokenizer",
        "loading weights: 13.1 MB",
        "loading weights: 25%",
        "loading weights: 50%",
        "loading weights: 75%",
    ]
    assert lines[5].startswith("weights loaded in ")
    assert lines[6:] == ["allocating the KV pool"]
