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
import textwrap
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
HEADER = """# API reference

Generated from the code by `python tools/api_reference.py` (a test keeps it current): every name
`import omnidraft as od` offers, then `omnidraft.aio` (the same requests from asyncio); each with
its signature and the first paragraph of its docstring, classes with their public methods and
properties. The guide is the [README](../README.md); how the pieces fit,
[architecture.md](architecture.md).
"""
WIDTH = 100
MODULES = ("omnidraft", "omnidraft.aio")


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


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


def _call(name: str, obj: Any) -> str:
    """`name` called as `obj` is, in a code block: on one line, or one parameter a line when long."""
    signature = _signature(obj)
    line = f"{name}{signature}"
    if len(line) <= WIDTH or signature == "(...)":
        return f"```python\n{line}\n```"
    head, _, returns = (
        signature.rpartition(" -> ") if " -> " in signature.split(")")[-1] else (signature, "", "")
    )
    inner = head[1:-1]
    params, depth, current = [], 0, ""
    for ch in inner:  # split on the commas between parameters, not inside brackets
        if ch == "," and depth == 0:
            params.append(current.strip())
            current = ""
            continue
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        current += ch
    params.append(current.strip())
    body = "".join(f"    {param},\n" for param in params if param)
    return f"```python\n{name}(\n{body})" + (f" -> {returns}" if returns else "") + "\n```"


def _members(cls: type) -> list[str]:
    lines = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            entry = f"- `{name}` (property): {_first_paragraph(member)}".rstrip(": ")
            lines.append(textwrap.fill(entry, WIDTH, subsequent_indent="  ", break_on_hyphens=False))
        elif inspect.isfunction(member):
            shown = cls.__name__ if name == "__init__" else f".{name}"
            text = _first_paragraph(member)
            entry = f"- `{shown}`" + (": " + text if text else "")
            lines.append(textwrap.fill(entry, WIDTH, subsequent_indent="  ", break_on_hyphens=False))
            lines.append(textwrap.indent(_call(shown, member), "  "))
    return lines


def _entry(name: str, obj: Any) -> str:
    where = getattr(obj, "__module__", None) or "omnidraft"
    if inspect.isclass(obj):
        parts = [f"### `{name}` (class, `{where}`)\n", _wrap(_first_paragraph(obj)) + "\n"]
        members = _members(obj)
        if members:
            parts.append("\n".join(members) + "\n")
        return "\n".join(parts)
    if callable(obj):
        return f"### `{name}` (`{where}`)\n\n{_call(name, obj)}\n\n{_wrap(_first_paragraph(obj))}\n"
    listed = ", ".join(sorted(obj))
    return f"### `{name}` ({type(obj).__name__})\n\n" + _wrap(f"{len(obj)} entries: {listed}") + "\n"


def page() -> str:
    import importlib

    parts = [HEADER]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        parts.append(f"## `{module_name}`\n")
        for name in sorted(module.__all__, key=str.lower):
            parts.append(_entry(name, getattr(module, name)))
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
