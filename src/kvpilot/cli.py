"""The `kvpilot` command line. Each subcommand lives in its own module and registers here."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kvpilot: an agent-aware LLM serving engine built around its KV-cache manager.",
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
