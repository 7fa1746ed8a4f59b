"""Write docs/api.md: every public name of `omnidraft` with its signature and the first paragraph
of its docstring; classes with their public methods and properties. tests/test_api_reference.py
checks that the committed page is what this writes, so the reference cannot drift from the code.

    python tools/api_reference.py            # rewrite docs/api.md
    python tools/api_reference.py --check    # exit 1 if docs/api.md is stale
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
HEADER = """# API reference

Generated from the code by `python tools/api_reference.py` (a test keeps it current): every name
`import omnidraft as od` offers, its signature and the first paragraph of its docstring. The
guide is the [README](../README.md); how the pieces fit, [architecture.md](architecture.md).
"""


def _first_paragraph(obj: Any) -> str:
    doc = inspect.cleandoc(obj.__doc__ or "")  # its own: not object.__init__'s boilerplate
    return " ".join(doc.split("\n\n", 1)[0].split())


def _signature(obj: Any) -> str:
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return "(...)"
    signature = inspect.signature(obj)
    if params and params[0].name in ("self", "cls"):
        signature = signature.replace(parameters=params[1:])
    return re.sub(r"(: |-> )'([^']*)'", r"\1\2", str(signature))  # annotations are strings here


def _members(cls: type) -> list[str]:
    lines = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            lines.append(f"- `{name}` (property): {_first_paragraph(member)}".rstrip(": "))
        elif inspect.isfunction(member):
            shown = cls.__name__ if name == "__init__" else f".{name}"
            lines.append(f"- `{shown}{_signature(member)}`: {_first_paragraph(member)}".rstrip(": "))
    return lines


def page() -> str:
    import omnidraft

    parts = [HEADER]
    for name in sorted(omnidraft.__all__, key=str.lower):
        obj = getattr(omnidraft, name)
        where = getattr(obj, "__module__", None) or "omnidraft"
        if inspect.isclass(obj):
            parts.append(f"## `{name}` (class, `{where}`)\n\n{_first_paragraph(obj)}\n")
            members = _members(obj)
            if members:
                parts.append("\n".join(members) + "\n")
        elif callable(obj):
            parts.append(f"## `{name}{_signature(obj)}` (`{where}`)\n\n{_first_paragraph(obj)}\n")
        else:
            parts.append(
                f"## `{name}` ({type(obj).__name__})\n\n{len(obj)} entries: {', '.join(sorted(obj))}\n"
            )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/api_reference.py", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not what this writes")
    args = p.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python tools/api_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
