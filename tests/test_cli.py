"""The command line as a user meets it: --version, simulate --help, one-line errors (traceback with
--debug)."""

from __future__ import annotations

import pytest

from omnidraft import __version__
from omnidraft.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"omnidraft {__version__}"


def test_simulate_help_is_device_sims_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--help"])
    assert done.value.code == 0 and "python -m omnidraft.device_sim" in capsys.readouterr().out


def test_an_error_is_one_line_and_debug_shows_the_traceback():
    with pytest.raises(SystemExit) as done:
        main(["generate", "hi", "--pair", "smollm2-135m:qwen-nope"])
    message = str(done.value.code)
    assert message.startswith("omnidraft generate: error:") and "qwen-nope" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match="qwen-nope"):
        main(["--debug", "generate", "hi", "--pair", "smollm2-135m:qwen-nope"])


def test_a_missing_optional_dependency_names_the_extra(monkeypatch):
    import sys

    from omnidraft.errors import MissingDependencyError
    from omnidraft.targets.remote import RemoteTarget

    monkeypatch.setitem(sys.modules, "httpx", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'omnidraft\[client\]'"):
        RemoteTarget("http://127.0.0.1:9")


def test_profiles_list_show_export_import_delete(tmp_path, capsys):
    """A profile exported from one store (one machine) and imported into another gives the same
    profile back; delete removes it."""
    from omnidraft.store.profiles import ProfileStore

    from .test_profiles import _profile

    a, b = tmp_path / "a", tmp_path / "b"
    profile = _profile()
    profile.user = "alice@example.com"
    ProfileStore(a).save(profile)
    pair = ["--drafter", "smollm2-135m", "--target", "qwen2.5-coder-0.5b"]
    main(["profiles", "list", "--store", str(a)])
    assert "'alice@example.com'" in capsys.readouterr().out
    main(
        [
            "profiles",
            "export",
            "--store",
            str(a),
            *pair,
            "--user",
            "alice@example.com",
            "--file",
            str(tmp_path / "x.tar"),
        ]
    )
    main(["profiles", "import", "--store", str(b), "--file", str(tmp_path / "x.tar")])
    moved = ProfileStore(b).load("smollm2-135m", "qwen2.5-coder-0.5b", "alice@example.com")
    assert moved.ngram == profile.ngram and moved.steps == profile.steps
    main(["profiles", "show", "--store", str(b), *pair, "--user", "alice@example.com"])
    assert '"steps": 3' in capsys.readouterr().out
    main(["profiles", "delete", "--store", str(b), *pair, "--user", "alice@example.com"])
    assert ProfileStore(b).load("smollm2-135m", "qwen2.5-coder-0.5b", "alice@example.com") is None
    with pytest.raises(SystemExit, match="no profile"):
        main(["profiles", "delete", "--store", str(b), *pair, "--user", "alice@example.com"])


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    import argparse

    from omnidraft.cli import api_keys

    args = argparse.Namespace(api_key_file=None, no_auth=False)
    monkeypatch.delenv("OMNIDRAFT_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="OMNIDRAFT_API_KEY"):
        api_keys(args)
    monkeypatch.setenv("OMNIDRAFT_API_KEY", "a, b")
    assert api_keys(args) == ("a", "b")
    (tmp_path / "k").write_text("only\n")
    assert api_keys(argparse.Namespace(api_key_file=str(tmp_path / "k"), no_auth=False)) == "only"
    from omnidraft.cli.commands import operator_key

    assert operator_key(argparse.Namespace(operator_key_file=None)) is None
    assert operator_key(argparse.Namespace(operator_key_file=str(tmp_path / "k"))) == "only"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        operator_key(argparse.Namespace(operator_key_file=str(tmp_path / "empty")))


def test_a_misspelled_or_missing_model_is_refused_before_anything_loads(monkeypatch):
    """A typo in --pair's target, or a local directory that is not there, is named before the
    drafter loads (which takes minutes on a first run)."""
    import omnidraft as od

    loads = []
    monkeypatch.setattr(od.Drafter, "load", staticmethod(lambda *a, **k: loads.append(a)))
    with pytest.raises(SystemExit, match="unknown preset 'qwen-coder-typo'"):
        main(["generate", "hi", "--pair", "smollm2-135m:qwen-coder-typo"])
    with pytest.raises(SystemExit, match="no model directory at .*my-small-lm"):
        main(["generate", "hi", "--pair", "./my-small-lm:qwen2.5-coder-0.5b"])
    assert loads == []
    with pytest.raises(FileNotFoundError, match="a preset .*, a .gguf file, a local directory or an HF id"):
        od.load_model("./my-small-lm")
