"""The `omnidraft` command: `commands.py` runs each subcommand, `options.py` parses their arguments
and loads what they name, `doctor.py` reports what this machine offers. Light: a module that imports
`options` (the bench does) loads no command."""

from importlib import import_module
from typing import Any

__all__ = ["api_keys", "main"]


def __getattr__(name: str) -> Any:  # the commands load on first use
    if name in __all__:
        return getattr(import_module(".commands", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
