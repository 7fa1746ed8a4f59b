"""The `omnidraft` command: generate, demo, bench, export, serve, doctor, profiles, simulate. The lab's
experiments are `python -m benchmarks` (benchmarks/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .cli_options import DRAFTER, TARGET, add_decoding_args, load_pair, split_pair, start_run
from .errors import OmnidraftError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="omnidraft", description="Cross-vocabulary speculative decoding.")
    p.add_argument("--version", action="version", version=f"omnidraft {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, print the whole traceback")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream one speculative generation")
    g.add_argument("prompt")
    g.add_argument("--pair", default=f"{DRAFTER}:{TARGET}", help="DRAFTER:TARGET (presets, .gguf paths or HF dirs)")
    g.add_argument("--mode", choices=["greedy", "match", "exact", "omnidraft"], default="greedy")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    add_decoding_args(g)

    d = sub.add_parser("demo", help="a few GSM8K and HumanEval prompts, omnidraft vs the target alone")
    d.add_argument("--target", default=TARGET)
    d.add_argument("--drafter", default=DRAFTER)
    d.add_argument("--n", type=int, default=2, help="prompts per dataset")
    add_decoding_args(d)

    b = sub.add_parser("bench", help="omnidraft vs target alone vs HF assisted generation")
    b.add_argument("--pair", action="append", help="DRAFTER:TARGET, repeatable")
    b.add_argument("--dataset", action="append", help="gsm8k | humaneval | FILE.jsonl, repeatable")
    b.add_argument("--n", type=int, default=10)
    b.add_argument("--peer", action="append", choices=["stock", "lookup", "assisted"],
                   help="peer rows beside the target alone, repeatable (default: all three): stock = the same model "
                        "on stock kernels, lookup = HF prompt lookup, assisted = HF assisted generation")
    b.add_argument("--no-peers", action="store_true", help="time only omnidraft and the target alone")
    b.add_argument("--out", default="bench_out")
    b.add_argument("--name", default="bench")
    b.add_argument("--trace", default=None, help="append per-round JSONL traces to this file")
    b.add_argument("--k-grid", type=int, action="append", metavar="K",
                   help="instead: the default pairing against each of these fixed draft lengths, paired per prompt")
    b.add_argument("--remote", action="store_true",
                   help="serve the target on loopback and verify over HTTP with --rtt injected per round trip")
    b.add_argument("--rtt", type=float, action="append", metavar="MS", help="round-trip time(s) in ms for --remote")
    b.add_argument("--target-backend", choices=["torch", "llama.cpp", "vllm"], default="torch",
                   help="llama.cpp: the target on llama.cpp, against llama.cpp alone, its own speculative decoding and "
                        "prompt lookup (with --remote: the server runs the target on llama.cpp); vllm: the target on "
                        "vLLM, against vLLM alone and vLLM's n-gram speculative decoding")
    b.add_argument("--relaxed", action="store_true",
                   help="with several --drafts: also the hybrid under relaxed verification, a LOSSY row, with ROUGE-L")
    add_decoding_args(b)
    e = sub.add_parser("export", help="export the drafter (with a pairing's adapter merged) to ONNX")
    e.add_argument("--drafter", default=DRAFTER)
    e.add_argument("--target", default=None, help="merge this target's adapter and prune for this pairing")
    e.add_argument("--user", default=None, help="whose profile's adapter (default: the target's default profile)")
    e.add_argument("--out", required=True, help="path ending in .onnx; the sidecar is OUT.json")
    e.add_argument("--quantize", choices=["int8"], default=None, help="dynamic int8 (onnxruntime quantizer)")
    e.add_argument("--prune", action="store_true",
                   help="keep only LM-head rows the pairing can use (shared vocabulary + n-gram sub-tokens); needs --target")
    e.add_argument("--parity-prompts", type=int, default=4, help="prompts for the export-time parity check (0: skip)")
    e.add_argument("--head", choices=["inside", "outside", "gather"], default="inside",
                   help="outside: the graph ends at the hidden state and the LM head is saved beside it; gather: "
                        "the graph evaluates the head rows a shortlist names (OrtDrafter.use_shortlist)")

    v = sub.add_parser("serve", help="a verification server for remote pairing (RemoteTarget)")
    v.add_argument("--target", default=TARGET)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key-file", default=None, help="file holding the API key(s) clients must send, one per line")
    v.add_argument("--no-auth", action="store_true", help="serve without an API key (loopback development only)")
    v.add_argument("--max-sessions", type=int, default=64)
    v.add_argument("--max-sessions-per-key", type=int, default=None,
                   help="sessions one API key may hold (the key file may list several keys, one per line)")
    v.add_argument("--engine", "--backend", dest="engine", choices=["torch", "llama.cpp", "vllm"], default="torch",
                   help="run the target on PyTorch (fp32), on llama.cpp (the preset's or .gguf file's own weights) or "
                        "on vLLM (sessions batched by its scheduler; pip install 'omnidraft[vllm]')")
    v.add_argument("--dtype", default=None, help="torch, vllm: the weights' dtype (float32, bfloat16, float16)")
    v.add_argument("--device", default=None, help="torch: where the target runs (cpu, cuda, cuda:N, mps; default cpu)")
    v.add_argument("--max-model-len", type=int, default=None, help="vllm: the longest session, in tokens")
    v.add_argument("--tensor-parallel-size", type=int, default=None, help="vllm: GPUs a model is split over")
    v.add_argument("--pipeline-parallel-size", type=int, default=None, help="vllm: pipeline stages (nodes)")
    v.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm: any other engine argument (JSON value or string), e.g. enforce_eager=true; repeatable")
    v.add_argument("--slots", type=int, default=4,
                   help="llama.cpp: sessions whose KV caches are kept side by side (each up to --n-ctx tokens)")
    v.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp: the longest session, in tokens")
    v.add_argument("--ttl", type=float, default=600.0, help="seconds an idle session is kept")

    f = sub.add_parser("profiles", help="users' pairing profiles: list, show, export, import, delete")
    f.add_argument("action", choices=["list", "show", "export", "import", "delete"])
    f.add_argument("--drafter", default=DRAFTER)
    f.add_argument("--target", default=TARGET)
    f.add_argument("--user", default=None, help="the user id (show, export, delete; import: install under this id)")
    f.add_argument("--file", default=None, help="export: the .tar to write; import: the .tar to read")
    f.add_argument("--store", default=None, help="profile store directory (default: $OMNIDRAFT_CACHE/profiles)")

    o = sub.add_parser("doctor", help="what this machine offers: backends, presets, and what was measured on it")
    o.add_argument("--target", action="append", default=[], help="also show this model's kernel plan, repeatable")
    o.add_argument("--reset", action="store_true",
                   help="forget every per-machine measurement (timed again at next use)")

    s = sub.add_parser("simulate", help="python -m device_sim with the same arguments", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _generate(args: argparse.Namespace) -> None:
    import torch

    pair = load_pair(*split_pair(args.pair), args)
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    for piece in pair.stream(args.prompt, max_new_tokens=args.max_new_tokens, generator=gen):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = pair.last.stats
    print(f"\n\n[{s.new_tokens} tokens, {s.tokens_per_second:.2f} tok/s, acceptance {s.acceptance_rate:.2f}, "
          f"τ {s.mean_accepted_length:.2f}, n-gram hits/round {s.ngram_hits_per_round:.2f}]", file=sys.stderr)


def _demo(args: argparse.Namespace) -> None:
    from .bench.commands import run_pair

    summaries, per_prompt = run_pair(f"{args.drafter}:{args.target}", ["gsm8k", "humaneval"], args, peers=(), trace=None)
    print(f"\nomnidraft demo: {args.drafter} drafting for {args.target}, greedy, {args.max_new_tokens} new tokens\n")
    print(f"{'prompt':<16}{'accept':>8}{'τ':>7}{'n-gram/rd':>11}{'omni tok/s':>12}{'target tok/s':>14}{'speedup':>9}  identical")
    for key, rows in per_prompt.items():
        for r in rows:
            tokens = r["new_tokens"]
            print(f"{key.split('/')[1] + ' #' + str(r['index']):<16}{r['acceptance_rate']:>8.2f}{r['mean_accepted_length']:>7.2f}"
                  f"{r['ngram_hits_per_round']:>11.2f}{tokens / r['omnidraft_s']:>12.2f}{tokens / r['target_s']:>14.2f}"
                  f"{r['speedup']:>8.2f}×  {'yes' if r['identical'] else 'NO'}")
    for s in summaries:
        print(f"{'total ' + s['dataset']:<16}{s['acceptance_rate']:>8.2f}{s['mean_accepted_length']:>7.2f}"
              f"{s['ngram_hits_per_round']:>11.2f}{s['omnidraft_tok_s']:>12.2f}{s['target_tok_s']:>14.2f}"
              f"{s['speedup']:>8.2f}×  {s['identical_rate']:.0%}")


def _export(args: argparse.Namespace) -> None:
    import json

    from .bench.datasets import load_prompts
    from .distill.adapters import config_from_state
    from .export.onnx import export_drafter
    from .models import load_model
    from .translate.token_bytes import build_token_bytes

    if args.prune and not args.target:
        raise SystemExit("--prune needs --target: pruning keeps the tokens that pairing can use")
    loaded = load_model(args.drafter)
    tokenizer, token_bytes = loaded.tokenizer, build_token_bytes(loaded.tokenizer, loaded.model.config.vocab_size)
    adapter, adapter_id, keep = None, None, None
    if args.target:
        adapter, adapter_id, keep = _pairing_for_export(loaded.name, tokenizer, token_bytes, args)
    prompts = [tokenizer(p)["input_ids"] for p in load_prompts("gsm8k", max(1, args.parity_prompts // 2))
               + load_prompts("humaneval", max(1, args.parity_prompts - args.parity_prompts // 2))][: args.parity_prompts]
    sidecar = export_drafter(loaded.model, args.out, name=loaded.name, tokenizer=tokenizer, fingerprint=token_bytes.fingerprint,
                             adapter=adapter, adapter_config=config_from_state(adapter) if adapter else None,
                             adapter_id=adapter_id, quantize=args.quantize, keep_ids=keep, parity_prompts=prompts or None,
                             head=args.head)
    shown = {k: v for k, v in sidecar.items() if k != "keep_ids"}
    shown["kept_tokens"] = len(sidecar["keep_ids"]) if sidecar["keep_ids"] else None
    print(json.dumps(shown, indent=1))


def _pairing_for_export(drafter_name: str, tokenizer: Any, token_bytes: Any, args: argparse.Namespace) -> tuple:
    """(adapter tensors, adapter id, kept token ids) of the (drafter, target, user) profile for export."""
    import omnidraft as od

    from .profiles import ProfileStore
    from .translate.vocab_map import build_vocab_map

    target = od.LocalTarget.load(args.target, kernels=False)
    fingerprint = f"{token_bytes.fingerprint}:{target.token_bytes.fingerprint}"
    profile = ProfileStore().load(drafter_name, target.name, args.user or "default", fingerprint=fingerprint)
    if profile is None and args.user:
        raise SystemExit(f"no profile of user {args.user!r} for {drafter_name} -> {target.name}")
    adapter = adapter_id = keep = None
    if profile is not None and "adapter" in profile.tensors:
        adapter, adapter_id = profile.tensors["adapter"], f"{target.name}/{profile.user}@step{profile.steps}"
    if args.prune:
        vmap = build_vocab_map(token_bytes, target.token_bytes, tokenizer, target.tokenizer)
        kept = set((vmap.d2t >= 0).nonzero().flatten().tolist())
        if profile is not None and profile.ngram is not None:
            kept |= {t for key, _ in profile.ngram["entries"] for t in key}
        kept |= {i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id) if isinstance(i, int)}
        keep = sorted(kept)
    return adapter, adapter_id, keep


def _serve(args: argparse.Namespace) -> None:
    from .optional import require

    uvicorn = require("uvicorn", "omnidraft serve")
    require("fastapi", "omnidraft serve")

    import omnidraft as od

    from .remote.server import ServerConfig, create_app, http_protocol

    key = api_keys(args)
    config = ServerConfig(api_key=key, max_sessions=args.max_sessions, ttl_s=args.ttl,
                          max_sessions_per_key=args.max_sessions_per_key)
    if args.engine == "vllm":
        target = od.VLLMTarget.load(args.target, **engine_args(args))
    elif args.engine == "llama.cpp":
        target = od.LlamaCppTarget(args.target, slots=args.slots, n_ctx=args.n_ctx)
    else:
        target = od.LocalTarget.load(args.target, device=args.device, dtype=args.dtype)
    print(f"omnidraft serve: {target.name} on {args.engine} at http://{args.host}:{args.port} - device sessions at "
          "/v1/sessions, OpenAI clients at /v1/models, /v1/completions, /v1/chat/completions; API key "
          f"{'required' if key else 'OFF'}", file=sys.stderr, flush=True)
    # on SIGTERM, streams in flight get GRACE_S seconds to finish, then the server stops
    uvicorn.run(create_app(target, config), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=GRACE_S, http=http_protocol())


GRACE_S = 30  # seconds a stopping server lets streams in flight finish
KEY_ENV = "OMNIDRAFT_API_KEY"  # the API key(s), comma-separated, when no --api-key-file is given


def api_keys(args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """The server's key(s): --api-key-file (one per line), else $OMNIDRAFT_API_KEY (comma-separated),
    else none with --no-auth; without any of them serve refuses to start."""
    import os

    if args.api_key_file is not None:
        keys = tuple(line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip())
        where = args.api_key_file
    elif os.environ.get(KEY_ENV):
        keys, where = tuple(k.strip() for k in os.environ[KEY_ENV].split(",") if k.strip()), f"${KEY_ENV}"
    elif args.no_auth:
        return None
    else:
        raise SystemExit(f"serve needs --api-key-file FILE or ${KEY_ENV} (or --no-auth for a loopback-only "
                         "development server)")
    if not keys:
        raise SystemExit(f"{where} is empty: put the API key in it (several: one per line, or comma-separated)")
    return keys[0] if len(keys) == 1 else keys


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine arguments from serve's flags: the named ones, then each --engine-arg KEY=VALUE
    (VALUE parsed as JSON where it is JSON, else kept as a string)."""
    named = {"dtype": args.dtype, "max_model_len": args.max_model_len,
             "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    out = {k: v for k, v in named.items() if v is not None}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg takes KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


def _profiles(args: argparse.Namespace) -> None:
    from .profiles import ProfileStore

    store = ProfileStore(args.store)
    if args.action == "list":
        for p in store.entries():
            print(f"{p.drafter} -> {p.target}  user {p.user!r}  steps {p.steps}  "
                  f"history {sum(map(len, (p.history or {}).get('docs', [])))} tokens")
        return
    if args.action != "import" and args.user is None:
        raise SystemExit(f"profiles {args.action} needs --user")
    if args.action == "show":
        p = store.load(args.drafter, args.target, args.user)
        if p is None:
            raise FileNotFoundError(f"no profile for user {args.user!r} of {args.drafter} -> {args.target}")
        print(json.dumps({"drafter": p.drafter, "target": p.target, "user": p.user, "steps": p.steps,
                          "tensors": sorted(p.tensors), "metrics": p.metrics[-3:]}, indent=1))
    elif args.action == "export":
        print(store.export(args.drafter, args.target, args.user, args.file or f"{args.user}.tar"))
    elif args.action == "import":
        if args.file is None:
            raise SystemExit("profiles import needs --file")
        p = store.import_file(args.file, user=args.user)
        print(f"imported the profile of {p.user!r} for {p.drafter} -> {p.target}")
    elif not store.delete(args.drafter, args.target, args.user):
        raise FileNotFoundError(f"no profile for user {args.user!r} of {args.drafter} -> {args.target}")


def _doctor(args: argparse.Namespace) -> None:
    from .doctor import report, reset

    print("\n".join(reset() if args.reset else report(args.target)))


def _simulate(args: argparse.Namespace) -> None:
    from device_sim.__main__ import main as simulate_main

    simulate_main(args.rest)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # every argument, --help included, is device_sim's
        from device_sim.__main__ import main as simulate_main

        simulate_main(argv[1:])
        return
    args = _parser().parse_args(argv)
    start_run(args)
    from .bench.commands import bench

    commands = {"generate": _generate, "demo": _demo, "bench": bench, "export": _export, "serve": _serve,
                "simulate": _simulate, "doctor": _doctor, "profiles": _profiles}
    try:
        commands[args.command](args)
    except (OmnidraftError, ValueError, OSError) as exc:  # the user's input or environment: one line, no traceback
        if args.debug:
            raise
        raise SystemExit(f"omnidraft {args.command}: error: {exc} (--debug shows the traceback)") from None


if __name__ == "__main__":
    main()
