"""Command-line options that `kvpilot serve` and `kvpilot sim` share: one name, one unit each.

Each is an ``Annotated`` type carrying its flag and help; a command declares it with its own
default (``block_size: BlockSize = None``). Sizes are strings with units ("32GiB", "2.5GB"),
read by `kvpilot.units.parse_bytes`. `engine_config` maps the scheduler and pool flags onto
an `EngineConfig` (through its flat names), so both commands build configs the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpilot.policy.pause import POLICY_NAMES
from kvpilot.units import parse_bytes

if TYPE_CHECKING:  # the engine (and NumPy) load only when a command runs
    from kvpilot.engine.config import EngineConfig

Model = Annotated[str, typer.Option(help="Checkpoint folder or 'tiny' (serve); preset (sim).")]
KvBlocks = Annotated[int | None, typer.Option(help="Device KV pool in blocks.")]
BlockSize = Annotated[
    int | None, typer.Option(help="Tokens per KV block (a power of two; default 16).")
]
MaxBatchedTokens = Annotated[
    int | None, typer.Option(help="Token budget of one step (default 2048).")
]
PrefillChunk = Annotated[
    int | None, typer.Option(help="Longest prefill chunk of a sequence per step (default 512).")
]
MaxNumSeqs = Annotated[int | None, typer.Option(help="Most sequences running at once.")]
TauHigh = Annotated[
    float | None,
    typer.Option(help="Admit new work only while device KV usage is below this (default 0.9)."),
]
MaxModelLen = Annotated[int | None, typer.Option(help="Cap on the model context (tokens).")]
HostMemory = Annotated[
    str | None,
    typer.Option(help="Host KV tier, with a unit, e.g. 32GiB (sim: per device; 0: none)."),
]
Policy = Annotated[str, typer.Option(help=f"Pause policy: {', '.join(POLICY_NAMES)}.")]


def size(text: str | None, flag: str = "size") -> int | None:
    """A size flag's bytes (None when the flag was not given); errors name ``flag``."""
    return None if text is None else int(parse_bytes(text, flag))


def engine_config(**flags: Any) -> EngineConfig:
    """An `EngineConfig` from flat option names; flags not given (None) keep the defaults."""
    from kvpilot.engine.config import EngineConfig

    return EngineConfig.from_kwargs(**{k: v for k, v in flags.items() if v is not None})
