"""`kvpilot demo`: the main job on built-in defaults, as a short readable transcript.

1. Sizing: `kvpilot plan` and `kvpilot frag` on their defaults.
2. The engine on the built-in `tiny` model: one agent session over several turns, with the
   cached (reused) tokens growing turn by turn; then a 4-way fork sharing one prefix, with
   the blocks it uses against what four private copies would take.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvpilot.engine import Engine, SamplingParams

TURNS = [
    "You are a coding agent. Fix the failing test in tests/test_parser.py.\n",
    "Tool result (run_tests): 1 failed: test_parse_empty_string - IndexError\n",
    "Tool result (open_file parser.py): def parse(s):\n    return s[0]\n",
    "Tool result (apply_patch): ok. Tool result (run_tests): all 14 passed\n",
]


def run_engine_demo(console: Console, model: str = "tiny") -> dict[str, float]:
    engine = Engine.from_pretrained(model, kv_blocks=512)
    block = engine.kv.block_size
    console.rule(f"[bold]Engine on `{model}`: one agent session, turn by turn")
    session = engine.open_session()
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=0)
    table = Table("turn", "prompt tokens", "cached tokens", "new tokens computed", "generated")
    for i, text in enumerate(TURNS, start=1):
        out = session.generate(text, params)
        table.add_row(
            str(i),
            str(out.prompt_tokens),
            str(out.cached_tokens),
            str(out.prompt_tokens - out.cached_tokens),
            str(out.generated_tokens),
        )
        engine.check_invariants()
    console.print(table)
    console.print(
        f"Session hit rate {engine.stats.hit_rate:.1%}: each turn computes only its new "
        "tokens: the rest of its context is reused."
    )

    console.rule("[bold]A 4-way fork sharing one prefix (copy-on-write)")
    used_before = engine.kv.device.num_used
    branches = session.fork(4)
    prefix_blocks = -(-session.num_tokens // block)
    for i, branch in enumerate(branches):
        branch.generate(f"Branch {i}: try approach #{i}.\n", SamplingParams(max_tokens=8, seed=i))
    used_after = engine.kv.device.num_used
    private = 4 * (prefix_blocks + 2)
    fork_table = Table("", "blocks")
    fork_table.add_row("shared prefix (one copy)", str(prefix_blocks))
    fork_table.add_row("blocks added by the fork and 4 branch turns", str(used_after - used_before))
    fork_table.add_row("4 private copies would need about", str(private))
    console.print(fork_table)
    engine.check_invariants()
    for s in [*branches, session]:
        s.close()
    engine.check_invariants()
    return {
        "hit_rate": engine.stats.hit_rate,
        "fork_blocks": float(used_after - used_before),
        "private_blocks": float(private),
    }
