"""docs/api.md is what tools/api_reference.py writes from the code: the reference cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_the_api_reference_is_current():
    path = Path(__file__).resolve().parent.parent / "tools" / "api_reference.py"
    spec = importlib.util.spec_from_file_location("api_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "docs/api.md is stale: run python tools/api_reference.py"


def test_the_api_reference_reads_on_a_screen_and_covers_the_async_api():
    import omnidraft
    import omnidraft.aio

    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    assert max(map(len, text.splitlines())) <= 100
    for name in [*omnidraft.__all__, *omnidraft.aio.__all__]:
        assert f"### `{name}`" in text, name
