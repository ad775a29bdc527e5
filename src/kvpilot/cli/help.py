"""Help that reads right: the command classes every `kvpilot` command and group uses.

- A boolean flag renders as a flag (``--json``), not as an option taking a value (Typer
  0.29's rich help prints ``--json <bool>``, ``--help <bool>``; the pinned Typer < 0.29
  does not, and this keeps it so if the pin is lifted).
- A group run with no arguments (bare ``kvpilot``, ``kvpilot trace``) prints its help and
  exits 0: asking what there is to run is not an error.
"""

from __future__ import annotations

from typing import Any

from typer import echo
from typer.core import TyperCommand, TyperGroup, TyperOption


def _flags_as_flags(params: list[Any]) -> list[Any]:
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""  # help shows no value; errors name the flag by its opts
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            text = ctx.get_help()  # Typer's rich help prints itself and returns ""
            if text:
                echo(text)
            ctx.exit(0)
        return super().parse_args(ctx, args)
