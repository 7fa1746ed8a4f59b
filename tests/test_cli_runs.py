"""What the README tells a user to run, end to end through the `omnidraft` entry point on tiny
models with a few tokens: `omnidraft demo` and `omnidraft bench` on every target backend (PyTorch,
llama.cpp, vLLM, --remote), each checked for its exit code and its report's rows. A change that
breaks one of them fails here, not in a user's first minute."""

from __future__ import annotations

import json
import os

import pytest

from omnidraft.cli import main

from .conftest import tiny_llama
from .tiny_gguf import write_tiny_gguf

FEW = ["--n", "1", "--max-new-tokens", "4"]
MACHINE_CACHE = os.environ.get("OMNIDRAFT_CACHE")  # the shipped models' cache, before `own_cache`


@pytest.fixture(scope="module")
def models(tmp_path_factory, draft_tokenizer, target_tokenizer):
    """The tiny drafter and target as a user hands them to the CLI: HF directories and GGUF files."""
    root = tmp_path_factory.mktemp("cli-models")
    out = {}
    for name, tokenizer, seed in (("drafter", draft_tokenizer, 2), ("target", target_tokenizer, 1)):
        model = tiny_llama(len(tokenizer), seed=seed, logit_scale=30.0, wide=True)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = str(root / name)
        out[f"{name}.gguf"] = str(write_tiny_gguf(model, tokenizer, root / f"{name}.gguf"))
    return out


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Per-machine measurements and converted models of these throwaway models stay out of the
    machine's cache."""
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path_factory.getbasetemp() / "cli-cache"))


def run_cli(argv: list[str]) -> int:
    """`omnidraft ARGV` in this process: its exit status (0 when it returns)."""
    try:
        main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def test_generate_streams_the_text_then_the_stats_line_python_prints(models, capsys):
    """`omnidraft generate` as the README shows it: the text on stdout, then on stderr the same
    stats line `print(out.stats)` gives (one format)."""
    pair = f"{models['drafter']}:{models['target']}"
    assert run_cli(["generate", "Tom has 3 apples", "--pair", pair, "--max-new-tokens", "4"]) == 0
    got = capsys.readouterr()
    assert got.out.strip() and got.err.strip().splitlines()[-1].startswith("[4 tokens in ")


def test_a_script_that_never_closes_its_llama_cpp_drafter_exits_quietly(models):
    """llama-cpp-python frees a model in `__del__`, which at exit runs after its library's names are
    gone and printed a TypeError on every such script: the SDK frees what is open before that."""
    import subprocess
    import sys

    code = f"import omnidraft as od; d = od.Drafter.load({models['drafter.gguf']!r}, backend='llama.cpp')"
    done = subprocess.run([sys.executable, "-c", code + "; print('ok')"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_demo_never_says_drafting_paid_where_every_request_decoded_alone():
    """A workload faster than the engine by noise alone (no request drafted) is one it stood aside on."""
    from omnidraft.bench.demo import verdict

    row = {"index": 0, "tokens": 8, "acceptance": 0.0, "tau": 1.0, "identical": True, "why": "cannot pay"}
    rows = [
        {**row, "dataset": "rag", "omnidraft_tok_s": 10.6, "engine_tok_s": 10.0, "speculating": False},
        {**row, "dataset": "chat", "omnidraft_tok_s": 13.0, "engine_tok_s": 10.0, "speculating": True},
    ]
    said = verdict(rows, "llama.cpp")
    assert (
        said.startswith("drafting paid on chat (1.30x)") and "stood aside on answers from documents" in said
    )


@pytest.mark.parametrize("kind", ["", ".gguf"])
def test_demo_runs_to_its_table_against_the_fastest_engine(models, capsys, kind):
    """An HF directory is compared with PyTorch; a GGUF file with llama.cpp (the faster engine for
    those weights on a CPU), which the demo names."""
    argv = ["demo", "--drafter", models["drafter" + kind], "--target", models["target" + kind], *FEW]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert ("against llama.cpp alone" if kind else "against PyTorch") in out
    for workload in ("chat", "summarize", "rag", "code-edit", "gsm8k"):  # what the SDK's users run
        assert f"{workload} #0" in out
    totals = [line for line in out.splitlines() if line.startswith("total ")]
    assert len(totals) == 5 and all("100% (worst request" in line for line in totals)  # identical outputs
    said = out.strip().splitlines()[-1]  # where drafting paid, and why it stood aside elsewhere
    assert said.startswith(("drafting paid on", "it stood aside on")) and said.endswith(".")


def test_bench_on_the_pytorch_target_reports_every_row(models, tmp_path, capsys):
    pair = f"{models['drafter']}:{models['target']}"
    argv = ["bench", "--pair", pair, "--dataset", "gsm8k", *FEW, "--out", str(tmp_path), "--name", "b"]
    assert run_cli(argv) == 0
    (summary,) = json.loads((tmp_path / "b.json").read_text())["summaries"]
    assert summary["identical_rate"] == 1.0 and summary["prompts"] == 1
    assert {"stock_speedup", "lookup_speedup", "assisted_speedup"} <= set(summary)
    assert summary["costs"]["target_step_ms"] > 0


def test_bench_through_the_server_reports_every_row(models, tmp_path):
    pair = f"{models['drafter']}:{models['target']}"
    argv = ["bench", "--remote", "--rtt", "0", "--pair", pair, "--dataset", "gsm8k", *FEW]
    assert run_cli([*argv, "--out", str(tmp_path), "--name", "r"]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) >= 2 and all(r["identical"] == r["prompts"] == 1 for r in rows)


def test_bench_through_a_llama_cpp_server_across_the_delaying_proxy_reports_every_row(models, tmp_path):
    """`omnidraft bench --remote --target-backend llama.cpp` (bench/network.py): the server in a
    process of its own on the first core, the device on the second behind the delaying proxy; the
    device's stream is the server's own output, and the bench leaves its process's cores as they were."""
    pair = f"{models['drafter.gguf']}:{models['target.gguf']}"
    argv = ["bench", "--remote", "--target-backend", "llama.cpp", "--rtt", "20", "--pair", pair, *FEW]
    cpus = os.sched_getaffinity(0)
    assert run_cli([*argv, "--dataset", "gsm8k", "--out", str(tmp_path), "--name", "n"]) == 0
    assert os.sched_getaffinity(0) == cpus
    rows = json.loads((tmp_path / "n.json").read_text())
    assert [r["row"] for r in rows] == ["server alone", "device drafting"]
    assert all(r["identical"] == r["requests"] == 1 and r["against"] for r in rows)
    assert rows[1]["worst_request_speedup"] > 0


def test_bench_on_llama_cpp_reports_every_row(models, tmp_path):
    pair = f"{models['drafter.gguf']}:{models['target.gguf']}"
    argv = ["bench", "--target-backend", "llama.cpp", "--pair", pair, "--dataset", "gsm8k", *FEW]
    assert run_cli([*argv, "--out", str(tmp_path), "--name", "l"]) == 0
    (rows,) = json.loads((tmp_path / "l.json").read_text()).values()
    names = {r["row"] for r in rows}
    assert "llama.cpp alone" in names and any(n.startswith("omnidraft") for n in names)
    assert all(r["identical"] for r in rows if r["row"] != "PyTorch fp32 target alone")


def test_bench_on_llama_cpp_repeats_each_request_and_keeps_only_omnidraft_without_peers(models, tmp_path):
    """`--repeats 2`: every request run twice, interleaved, its time the median; `--no-peers`: only
    llama.cpp alone and omnidraft's rows; a repeat count below 1 is a usage error."""
    pair = f"{models['drafter.gguf']}:{models['target.gguf']}"
    argv = ["bench", "--target-backend", "llama.cpp", "--pair", pair, "--dataset", "gsm8k", *FEW]
    assert run_cli([*argv, "--no-peers", "--repeats", "2", "--out", str(tmp_path), "--name", "l"]) == 0
    (rows,) = json.loads((tmp_path / "l.json").read_text()).values()
    names = {r["row"] for r in rows}
    assert "llama.cpp alone" in names and all(
        n == "llama.cpp alone" or n.startswith("omnidraft") for n in names
    )
    assert all(r["identical"] and len(r["runs"]) == 2 for r in rows)
    assert run_cli([*argv, "--repeats", "0", "--out", str(tmp_path)]) == 2  # argparse's usage error


@pytest.mark.exclusive  # vLLM binds its own threads: run with the other vLLM tests
def test_bench_on_vllm_reports_every_row(models, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_VLLM_EAGER", "1")  # its three engines start without compiling
    pair = f"{models['drafter']}:{models['target']}"
    argv = ["bench", "--target-backend", "vllm", "--pair", pair, "--dataset", "gsm8k", *FEW, "--no-peers"]
    assert run_cli([*argv, "--out", str(tmp_path), "--name", "v"]) == 0
    (rows,) = json.loads((tmp_path / "v.json").read_text()).values()
    assert {r["row"] for r in rows} >= {"vLLM alone", "omnidraft (default)"}
    assert all(r["identical"] for r in rows)


@pytest.mark.real
def test_make_demo_runs_to_its_table_on_the_shipped_models(tmp_path):
    """`make demo`'s own command (the installed `omnidraft` script, the default pair, the exporter
    `make demo` names), cut to one prompt per dataset and a few tokens, its target on OpenVINO: it
    exits 0 after printing its table."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "omnidraft"
    env = {k: v for k, v in os.environ.items() if k != "OMNIDRAFT_CACHE"}
    env["OMNIDRAFT_OPENVINO_PYTHON"] = str(Path(__file__).resolve().parents[1] / ".venv-openvino/bin/python")
    if MACHINE_CACHE is not None:
        env["OMNIDRAFT_CACHE"] = MACHINE_CACHE
    # the shipped 0.5B on OpenVINO, exported once as test_openvino.py's real test exports it: `auto`
    # would also export it with int4 weights and time every engine (seven minutes of CI on a Zen 3
    # host); choosing by timing is tests/test_fastest_engine.py's, `auto` on llama.cpp alone the
    # install test's demo (the 1.5B's export, the same code, would add two minutes more)
    argv = [str(script), "demo", *FEW, "--repeats", "1", "--target", "qwen2.5-coder-0.5b"]
    argv += ["--target-backend", "openvino"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(f"total {w}" in done.stdout for w in ("chat", "summarize", "rag", "code-edit", "gsm8k"))
    assert done.stdout.strip().splitlines()[-1].startswith(("drafting paid on", "it stood aside on"))


def test_doctor_tries_each_drafter_backend_in_a_child_and_says_which_a_pairing_uses(
    models, capsys, monkeypatch
):
    """`omnidraft doctor --drafter FILE` loads the file on each backend in a child process and
    drafts a few tokens, so a backend that crashes this machine shows as FAILED there, not in a
    pairing; then it names the backend a pairing will draft on."""
    monkeypatch.delenv("OMNIDRAFT_DRAFTER_BACKEND", raising=False)
    assert run_cli(["doctor", "--drafter", models["drafter.gguf"]]) == 0
    out = capsys.readouterr().out
    assert "  torch: ok (3 tokens drafted" in out
    assert "  llama.cpp: ok" in out and "  onnx: onnxruntime ok (a test graph ran" in out
    assert "a pairing drafts on PyTorch, or through the same file on llama.cpp" in out


def test_doctor_names_a_backend_that_kills_its_process_and_keeps_pairings_off_it(monkeypatch):
    from omnidraft.cli import doctor
    from omnidraft.llamacpp import smoke

    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert doctor._child(crash) == "FAILED: killed by SIGSEGV"
    monkeypatch.setattr(
        smoke, "runs", lambda path: "killed by SIGSEGV (a llama.cpp build this CPU cannot run)"
    )
    monkeypatch.setattr(
        doctor, "_child", lambda code, *argv: "ok (3 tokens drafted, 1.0 s in a child process)"
    )
    monkeypatch.delenv("OMNIDRAFT_DRAFTER_BACKEND", raising=False)
    monkeypatch.setattr(doctor, "_gguf", lambda spec: "/x/drafter.gguf")
    lines = doctor.backends("drafter.gguf")
    assert "  llama.cpp: FAILED: killed by SIGSEGV (a llama.cpp build this CPU cannot run)" in lines
    assert lines[-1] == "a pairing drafts on PyTorch (llama.cpp failed its smoke test here)"
