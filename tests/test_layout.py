"""The shape of the package: the SDK imports no lab module and nothing heavy on import, has no
import cycle (imports inside functions count, type-only ones under `if TYPE_CHECKING:` count, and
so do the parent packages an import runs: layers import one way) and no file over the line
ceiling."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "omnidraft"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules that `path` imports anywhere: at the top, inside functions, for types only."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found |= {f"{name}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the SDK modules importing it runs: each module it imports and that module's parent
    packages (their `__init__` runs first; the SDK's own top `__init__` is kept light by its own
    test), except the packages it is itself inside."""
    modules = {_module(p): p for p in SDK.rglob("*.py")}
    graph = {}
    for m, p in modules.items():
        edges = set()
        for i in _imports(p):
            if i not in modules:
                continue
            parts = i.split(".")
            edges |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)}
        graph[m] = {e for e in edges if e in modules and e != m and not m.startswith(e + ".")}
    return graph


def test_no_import_cycle_in_the_sdk():
    graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


REVIEW_LINES = 400  # past this a file is worth a look at where its concepts part (a warning)
MAX_LINES = 600  # past this one surely holds more than one


def test_the_sdk_never_imports_the_lab_and_no_file_is_over_the_line_ceiling():
    """Files are split by concept, not by a count: the ceiling fails the suite, the review
    threshold only names the files past it."""
    long = []
    for path in SDK.rglob("*.py"):
        assert not any(i.split(".")[0] == "benchmarks" for i in _imports(path)), path
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, (path, lines)
        if lines > REVIEW_LINES:
            long.append(f"{path.relative_to(ROOT)} ({lines})")
    if long:
        warnings.warn(f"past {REVIEW_LINES} lines, worth a review: {', '.join(long)}", stacklevel=1)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = function.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + bool(a.vararg) + bool(a.kwarg)


def test_no_function_is_over_80_lines_and_at_most_three_take_over_8_parameters():
    """Long and wide functions are where a reader gets lost: none over 80 lines, and over 8
    parameters only the three the public API needs (`pair`, `Pairing`, the OpenAI client's
    options; `**overrides` and `*args` count as one each, `self` not at all)."""
    functions = [
        (path.relative_to(ROOT), node)
        for path in SDK.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    long = [(str(p), f.name) for p, f in functions if f.end_lineno - f.lineno + 1 > 80]
    wide = sorted((str(p), f.name) for p, f in functions if _parameters(f) > 8)
    assert long == []
    assert len(wide) <= 3, wide


def test_the_shipped_bench_and_the_lab_share_no_file_name():
    """`omnidraft/bench/` (in the wheel) and `benchmarks/` (the lab): a name says which one."""
    shipped = {p.name for p in (SDK / "bench").glob("*.py")} - {"__init__.py", "__main__.py"}
    lab = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not shipped & lab, sorted(shipped & lab)


def test_the_core_never_imports_the_bench():
    """The bench (omnidraft/bench/) is a command of the CLI, never a dependency of the library: no
    module outside it imports it, except the CLI inside the function of its `bench` command."""
    for path in SDK.rglob("*.py"):
        if path.parent.name in ("bench", "cli"):
            continue
        assert not any(i.startswith("omnidraft.bench") for i in _imports(path)), path
    top = ast.parse((SDK / "cli" / "commands.py").read_text(encoding="utf-8")).body
    assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bench") for n in top)


def test_importing_the_sdk_loads_no_lab_server_or_plotting_module():
    probe = (
        "import sys, omnidraft as od; od.Drafter, od.LocalTarget, od.Pairing, od.DecodeConfig, od.pair; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'fastapi', 'uvicorn', "
        "'matplotlib')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_readme_is_a_user_guide():
    """At most 200 lines, the two set-up commands first, install, the own-model quickstart and the
    cloud set-up within the first 100 lines, and every page it links exists."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200
    commands = [line.split("#")[0].strip() for line in lines[:8] if line.startswith("make ")]
    assert commands == ["make demo", "make test"]
    head = "\n".join(lines[:100])
    for needle in ("## Install", "Your own models", "## Remote and cloud targets", "od.RemoteTarget("):
        assert needle in head, needle
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)", text):
        assert (ROOT / link).is_file(), link
