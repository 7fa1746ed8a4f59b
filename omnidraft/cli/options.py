"""What the `omnidraft` command, its bench and the lab (`python -m benchmarks`) share: the default
models, DRAFTER:TARGET specs, the decoding options and the pairing built from them."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING, Any

from .deploy import deploy_args

if TYPE_CHECKING:
    from ..pairing import Pairing

__all__ = ["DRAFTER", "TARGET", "add_decoding_args", "build_parser", "load_pair", "split_pair", "start_run"]

DRAFTER = "smollm2-135m"
TARGET = "qwen2.5-coder-1.5b"


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_decoding_args(q: argparse.ArgumentParser) -> None:
    """The decoding options every command that builds a pairing takes."""
    from ..draft.base import BACKEND_ENV, BACKENDS

    q.add_argument(
        "--k",
        type=int,
        default=None,
        help="fixed drafter tokens per round (default: chosen each round from the pairing's measured "
        "costs, 0 where drafting cannot pay; the lab commands use 6)",
    )
    q.add_argument(
        "--stop-confidence",
        type=float,
        default=0.3,
        help="end a draft after a token the drafter gives less probability than this (0: never)",
    )
    q.add_argument("--strategy", choices=["text", "ngram"], default="text")
    q.add_argument(
        "--adaptive-k",
        type=int,
        default=None,
        metavar="K_MAX",
        help="move the draft length with acceptance (hysteresis), up to K_MAX; default: fixed --k",
    )
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument(
        "--drafter-backend",
        choices=list(BACKENDS),
        default=None,
        help="the drafter's backend: torch, llama.cpp, onnx or auto (fastest here); default: "
        f"${BACKEND_ENV}, else PyTorch drafting through llama.cpp where that runs and is faster here",
    )
    q.add_argument(
        "--drafts",
        action="append",
        choices=["hybrid", "model", "retrieval"],
        help="where drafts come from (default hybrid: the drafter model or text retrieved from the "
        "context, whichever is expected to be faster); `bench` takes several and compares them",
    )


def split_pair(pair: str) -> tuple[str, str]:
    """ "DRAFTER:TARGET" -> (drafter spec, target spec); exits with the usage error otherwise."""
    drafter, sep, target = pair.partition(":")
    if not sep or not drafter or not target:
        raise SystemExit(f"--pair must be DRAFTER:TARGET, got {pair!r}")
    from ..store.models import check_spec

    for spec in (drafter, target):  # before either loads: a typo costs no model load
        check_spec(spec)
    return drafter, target


def load_pair(drafter_spec: str, target_spec: str, args: argparse.Namespace) -> Pairing:
    """Load both models and pair them with the decoding options in `args`."""
    import omnidraft as od

    started = time.perf_counter()
    from ..targets.registry import engine

    drafter = od.Drafter.load(drafter_spec, backend=getattr(args, "drafter_backend", None))
    target = engine(getattr(args, "target_backend", "torch")).load(target_spec, {})
    logging.getLogger("omnidraft").debug(
        "loaded %s and %s in %.1f s", drafter, target, time.perf_counter() - started
    )
    extra = {"mode": getattr(args, "mode", "greedy"), "temperature": getattr(args, "temperature", 0.0)}
    if args.adaptive_k is not None:
        from ..adaptive.policy import Hysteresis

        extra["adaptive"] = Hysteresis(k_min=2, k_max=args.adaptive_k)
    return drafter.pair(
        target,
        k=args.k,
        stop_confidence=args.stop_confidence,
        strategy=args.strategy,
        drafts=(args.drafts or ["hybrid"])[0],
        **extra,
    )


def start_run(args: argparse.Namespace) -> None:
    """A command's start: log lines to stderr (the chatty libraries quiet), counts checked."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "httpx", "huggingface_hub", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if getattr(args, "n", 1) < 1 or getattr(args, "max_new_tokens", 1) < 1:
        raise SystemExit(
            f"--n and --max-new-tokens must be >= 1, got {getattr(args, 'n', 1)} and "
            f"{getattr(args, 'max_new_tokens', 1)}"
        )


def build_parser() -> argparse.ArgumentParser:
    """The `omnidraft` command's arguments, every subcommand's (one function each, below)."""
    from .. import __version__

    p = argparse.ArgumentParser(prog="omnidraft", description="Cross-vocabulary speculative decoding.")
    p.add_argument("--version", action="version", version=f"omnidraft {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, print the whole traceback")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (
        _generate_args,
        _demo_args,
        _bench_args,
        _export_args,
        _serve_args,
        deploy_args,
        _profiles_args,
        _doctor_args,
        _simulate_args,
    ):
        add(sub)
    return p


def _generate_args(sub: Any) -> None:
    """`omnidraft generate`: stream one speculative generation."""
    from ..targets.registry import engine_names

    g = sub.add_parser("generate", help="stream one speculative generation")
    g.add_argument("prompt")
    g.add_argument(
        "--pair", default=f"{DRAFTER}:{TARGET}", help="DRAFTER:TARGET (presets, .gguf paths or HF dirs)"
    )
    g.add_argument("--mode", choices=["greedy", "match", "exact", "omnidraft"], default="greedy")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--target-backend",
        choices=engine_names(),
        default="auto",
        help="the target's engine (default auto: the fastest here for its weights, as load_target picks)",
    )
    add_decoding_args(g)


def _demo_args(sub: Any) -> None:
    """`omnidraft demo`: the default pairing against the fastest engine alone."""
    d = sub.add_parser(
        "demo",
        help="chat, summaries, answers from documents, code edits, math: omnidraft vs the fastest engine",
    )
    d.add_argument("--target", default=TARGET)
    d.add_argument("--drafter", default=DRAFTER)
    d.add_argument("--n", type=int, default=1, help="prompts per workload")
    d.add_argument("--repeats", type=at_least_one, default=3, help="runs a side per request (median)")
    d.add_argument(
        "--target-backend",
        choices=["auto", "llama.cpp", "openvino", "openvino-int4", "torch"],
        default="auto",
        help="the engine the target runs on and is compared with (auto: the fastest here for its weights)",
    )
    add_decoding_args(d)


def _bench_args(sub: Any) -> None:
    """`omnidraft bench`: every contender on the chosen target engine (bench/)."""
    from ..targets.registry import engine_names

    b = sub.add_parser("bench", help="omnidraft vs target alone vs HF assisted generation")
    b.add_argument("--pair", action="append", help="DRAFTER:TARGET, repeatable")
    b.add_argument("--dataset", action="append", help="gsm8k | humaneval | FILE.jsonl, repeatable")
    b.add_argument("--n", type=int, default=10)
    b.add_argument(
        "--peer",
        action="append",
        choices=["stock", "lookup", "assisted"],
        help="peer rows beside the target alone, repeatable (default: all three): stock = the same model "
        "on stock kernels, lookup = HF prompt lookup, assisted = HF assisted generation",
    )
    b.add_argument("--no-peers", action="store_true", help="time only omnidraft and the target alone")
    b.add_argument(
        "--repeats",
        type=at_least_one,
        default=1,
        help="llama.cpp: run each prompt's rows this many times, interleaved; vllm: run the rows in turn "
        "this many times over, each on a fresh engine; a request's time is the median of its runs",
    )
    b.add_argument("--out", default="bench_out")
    b.add_argument("--name", default="bench")
    b.add_argument("--trace", default=None, help="append per-round JSONL traces to this file")
    b.add_argument(
        "--k-grid",
        type=int,
        action="append",
        metavar="K",
        help="instead: the default pairing against each of these fixed draft lengths, paired per prompt",
    )
    b.add_argument(
        "--remote",
        action="store_true",
        help="serve the target on loopback and verify over HTTP with --rtt injected per round trip",
    )
    b.add_argument(
        "--rtt", type=float, action="append", metavar="MS", help="round-trip time(s) in ms for --remote"
    )
    b.add_argument(
        "--devices",
        type=int,
        action="append",
        metavar="N",
        help="with --remote --target-backend vllm: devices streaming at once, repeatable (default 1)",
    )
    b.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="with --remote --target-backend vllm: every row samples at this temperature (0: greedy)",
    )
    b.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the top-p filter")
    b.add_argument(
        "--no-stock",
        action="store_true",
        help="with --remote --target-backend vllm: skip the stock vLLM server row",
    )
    b.add_argument(
        "--target-backend",
        choices=engine_names(),
        default="auto",
        help="the target's engine (targets/registry.py; default auto: the fastest here for the first pair's "
        "target, as load_target picks). llama.cpp: against llama.cpp alone, its own "
        "speculative decoding and prompt lookup (with --remote: the server runs the target on llama.cpp); "
        "vllm: against vLLM alone and vLLM's n-gram speculative decoding; another engine: the pairing "
        "against the target decoding alone",
    )
    b.add_argument(
        "--relaxed",
        action="store_true",
        help="with several --drafts: also the hybrid under relaxed verification, a LOSSY row, with ROUGE-L",
    )
    add_decoding_args(b)


def _export_args(sub: Any) -> None:
    """`omnidraft export`: a drafter to ONNX."""
    e = sub.add_parser("export", help="export the drafter (with a pairing's adapter merged) to ONNX")
    e.add_argument("--drafter", default=DRAFTER)
    e.add_argument("--target", default=None, help="merge this target's adapter and prune for this pairing")
    e.add_argument(
        "--user", default=None, help="whose profile's adapter (default: the target's default profile)"
    )
    e.add_argument("--out", required=True, help="path ending in .onnx; the sidecar is OUT.json")
    e.add_argument("--quantize", choices=["int8"], default=None, help="dynamic int8 (onnxruntime quantizer)")
    e.add_argument(
        "--prune",
        action="store_true",
        help="keep only LM-head rows the pairing can use (shared vocabulary + n-gram sub-tokens); needs "
        "--target",
    )
    e.add_argument(
        "--parity-prompts", type=int, default=4, help="prompts for the export-time parity check (0: skip)"
    )
    e.add_argument(
        "--head",
        choices=["inside", "outside", "gather"],
        default=None,
        help="outside: the graph ends at the hidden state and the LM head is saved beside it; gather: "
        "the graph evaluates the head rows a shortlist names (OrtDrafter.use_shortlist); default: "
        "inside (outside with --exporter optimum, its only choice)",
    )
    e.add_argument(
        "--exporter",
        choices=["omnidraft", "optimum"],
        default="omnidraft",
        help="omnidraft: our graph (Llama, Gemma 3); optimum: any architecture optimum-onnx exports, run "
        "in its own Python (--optimum-python; docs/onnx.md)",
    )
    e.add_argument(
        "--optimum-python",
        default=None,
        help="a Python with optimum-onnx (default: the OMNIDRAFT_OPTIMUM_PYTHON variable)",
    )


def _serve_args(sub: Any) -> None:
    """`omnidraft serve`: a verification server on a registered engine."""
    from ..targets.registry import ENGINES, engine_names

    v = sub.add_parser("serve", help="a verification server for remote pairing (RemoteTarget)")
    v.add_argument("--target", default=TARGET)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument(
        "--api-key-file", default=None, help="file holding the API key(s) clients must send, one per line"
    )
    v.add_argument("--operator-key-file", help="file holding the key that reads /metrics (docs/remote.md)")
    v.add_argument(
        "--no-auth", action="store_true", help="serve without an API key (loopback development only)"
    )
    v.add_argument("--max-sessions", type=int, default=64)
    v.add_argument(
        "--log-requests",
        action="store_true",
        help="log one line per request to stderr: method, path, status, seconds, which API key",
    )
    v.add_argument(
        "--share-adapters",
        metavar="DIR",
        default=None,
        help="take devices' LoRA adapters for this target and serve their average (docs/personalization.md)",
    )
    v.add_argument(
        "--adapter-min-keys", type=int, default=2, help="API keys whose uploads make a round of the average"
    )
    v.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=None,
        help="sessions one API key may hold (default: an equal share of --max-sessions per key; the key "
        "file may list several keys, one per line)",
    )
    v.add_argument(
        "--engine",
        "--backend",
        dest="engine",
        choices=engine_names(),
        default="auto",
        help="the engine the target runs on: "
        + "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values()),
    )
    v.add_argument(
        "--dtype", default=None, help="torch, vllm: the weights' dtype (float32, bfloat16, float16)"
    )
    v.add_argument(
        "--device", default=None, help="torch: where the target runs (cpu, cuda, cuda:N, mps; default cpu)"
    )
    v.add_argument("--max-model-len", type=int, default=None, help="vllm: the longest session, in tokens")
    v.add_argument("--tensor-parallel-size", type=int, default=None, help="vllm: GPUs a model is split over")
    v.add_argument("--pipeline-parallel-size", type=int, default=None, help="vllm: pipeline stages (nodes)")
    v.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm: any other engine argument (JSON value or string), e.g. enforce_eager=true; repeatable",
    )
    v.add_argument("--slots", type=int, default=4, help="llama.cpp: sessions whose KV caches are kept")
    v.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp: the longest session, in tokens")
    v.add_argument("--ttl", type=float, default=600.0, help="seconds an idle session is kept")


def _profiles_args(sub: Any) -> None:
    """`omnidraft profiles`: users' pairing profiles."""
    f = sub.add_parser("profiles", help="users' pairing profiles: list, show, export, import, delete")
    f.add_argument("action", choices=["list", "show", "export", "import", "delete"])
    f.add_argument("--drafter", default=DRAFTER)
    f.add_argument("--target", default=TARGET)
    f.add_argument(
        "--user", default=None, help="the user id (show, export, delete; import: install under this id)"
    )
    f.add_argument("--file", default=None, help="export: the .tar to write; import: the .tar to read")
    f.add_argument(
        "--store", default=None, help="profile store directory (default: $OMNIDRAFT_CACHE/profiles)"
    )


def _doctor_args(sub: Any) -> None:
    """`omnidraft doctor`: what this machine offers and measured."""
    o = sub.add_parser(
        "doctor", help="what this machine offers: backends, presets, and what was measured on it"
    )
    o.add_argument(
        "--target", action="append", default=[], help="also show this model's kernel plan, repeatable"
    )
    o.add_argument(
        "--drafter",
        default=DRAFTER,
        help="try each drafter backend on this model in a child process (default: the drafter preset, "
        "when installed); 'none' skips it",
    )
    o.add_argument(
        "--reset", action="store_true", help="forget every per-machine measurement (timed again at next use)"
    )
    o.add_argument(
        "--clear-cache",
        action="store_true",
        help="remove the cache's converted and exported models (rebuilt at next use); profiles stay",
    )


def _simulate_args(sub: Any) -> None:
    """`omnidraft simulate`: device_sim's command line."""
    s = sub.add_parser(
        "simulate", help="python -m omnidraft.device_sim with the same arguments", add_help=False
    )
    s.add_argument("rest", nargs=argparse.REMAINDER)
