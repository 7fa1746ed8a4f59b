"""What the `omnidraft` command, its bench and the lab (`python -m benchmarks`) share: the default
models, DRAFTER:TARGET specs, the decoding options and the pairing built from them."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

__all__ = ["DRAFTER", "TARGET", "add_decoding_args", "load_pair", "split_pair", "start_run"]

DRAFTER = "smollm2-135m"
TARGET = "qwen2.5-coder-1.5b"


def add_decoding_args(q: argparse.ArgumentParser) -> None:
    """The decoding options every command that builds a pairing takes."""
    q.add_argument("--k", type=int, default=None,
                   help="fixed drafter tokens per round (default: chosen each round from the pairing's measured "
                        "costs, 0 where drafting cannot pay; the lab commands use 6)")
    q.add_argument("--stop-confidence", type=float, default=0.3,
                   help="end a draft after a token the drafter gives less probability than this (0: never)")
    q.add_argument("--strategy", choices=["text", "ngram"], default="text")
    q.add_argument("--adaptive-k", type=int, default=None, metavar="K_MAX",
                   help="move the draft length with acceptance (hysteresis), up to K_MAX; default: fixed --k")
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--drafts", action="append", choices=["hybrid", "model", "retrieval"],
                   help="where drafts come from (default hybrid: the drafter model or text retrieved from the "
                        "context, whichever is expected to be faster); `bench` takes several and compares them")


def split_pair(pair: str) -> tuple[str, str]:
    """"DRAFTER:TARGET" -> (drafter spec, target spec); exits with the usage error otherwise."""
    drafter, sep, target = pair.partition(":")
    if not sep or not drafter or not target:
        raise SystemExit(f"--pair must be DRAFTER:TARGET, got {pair!r}")
    return drafter, target


def load_pair(drafter_spec: str, target_spec: str, args: argparse.Namespace) -> Any:
    """Load both models and pair them with the decoding options in `args`."""
    import omnidraft as od

    started = time.perf_counter()
    drafter, target = od.Drafter.load(drafter_spec), od.LocalTarget.load(target_spec)
    logging.getLogger("omnidraft").info("loaded %s and %s in %.1f s", drafter, target, time.perf_counter() - started)
    extra = {"mode": getattr(args, "mode", "greedy"), "temperature": getattr(args, "temperature", 0.0)}
    if args.adaptive_k is not None:
        from .adaptive.policy import Hysteresis

        extra["adaptive"] = Hysteresis(k_min=2, k_max=args.adaptive_k)
    return drafter.pair(target, k=args.k, stop_confidence=args.stop_confidence, strategy=args.strategy,
                        drafts=(args.drafts or ["hybrid"])[0], **extra)


def start_run(args: argparse.Namespace) -> None:
    """A command's start: log lines to stderr (the chatty libraries quiet), counts checked."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if getattr(args, "n", 1) < 1 or getattr(args, "max_new_tokens", 1) < 1:
        raise SystemExit(f"--n and --max-new-tokens must be >= 1, got {getattr(args, 'n', 1)} and "
                         f"{getattr(args, 'max_new_tokens', 1)}")
