"""`python -m kvpilot.cli`."""

from kvpilot.cli import main

main()
