"""`python -m omnidraft.cli ...`: the `omnidraft` command."""

from .commands import main

main()
