"""The `omnidraft` command: generate, demo, bench, export, serve, doctor, profiles, simulate. The lab's
experiments are `python -m benchmarks` (benchmarks/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import OmnidraftError
from ..wire import KEY_ENV, env_keys
from .deploy import deploy
from .options import build_parser, load_pair, split_pair, start_run

__all__ = ["main"]


def _generate(args: argparse.Namespace) -> None:
    import torch

    pair = load_pair(*split_pair(args.pair), args)
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    for piece in pair.stream(args.prompt, max_new_tokens=args.max_new_tokens, generator=gen):
        sys.stdout.write(piece)
        sys.stdout.flush()
    assert pair.last is not None  # a finished stream leaves its Generation
    print(f"\n\n[{pair.last.stats}]", file=sys.stderr)  # the stats line Python prints (one format)


def _demo(args: argparse.Namespace) -> None:
    from ..bench.demo import WORKLOADS, run_demo, verdict, workloads

    engine, rows = run_demo(args, list(WORKLOADS))
    print(
        f"\nomnidraft demo: {args.drafter} drafting for {args.target}, greedy, {args.max_new_tokens} new "
        f"tokens, against {engine} alone (the fastest way to run these weights here)\n"
    )
    print(
        f"{'prompt':<16}{'accept':>8}{'τ':>7}{'omni tok/s':>12}{'alone tok/s':>13}{'speedup':>9}  identical"
    )
    for r in rows:
        print(
            f"{r['dataset'] + ' #' + str(r['index']):<16}{r['acceptance']:>8.2f}{r['tau']:>7.2f}"
            f"{r['omnidraft_tok_s']:>12.2f}{r['engine_tok_s']:>13.2f}"
            f"{r['omnidraft_tok_s'] / r['engine_tok_s']:>8.2f}×  {'yes' if r['identical'] else 'NO'}"
        )
    for dataset, w in workloads(rows).items():
        omni, alone, mine = w["omni"], w["alone"], w["rows"]
        print(
            f"{'total ' + dataset:<16}{'':>15}{omni:>12.2f}{alone:>13.2f}{omni / alone:>8.2f}×  "
            f"{sum(r['identical'] for r in mine) / len(mine):.0%} (worst request {w['worst']:.2f}×)"
        )
    print("\n" + verdict(rows, engine))


def _export(args: argparse.Namespace) -> None:
    import json

    from ..bench.datasets import load_prompts
    from ..distill.adapters import config_from_state
    from ..export.onnx import ExportOptions, MergedAdapter, export_drafter
    from ..store.models import load_model
    from ..translate.token_bytes import build_token_bytes

    if args.prune and not args.target:
        raise SystemExit("--prune needs --target: pruning keeps the tokens that pairing can use")
    loaded = load_model(args.drafter)
    tokenizer, token_bytes = (
        loaded.tokenizer,
        build_token_bytes(loaded.tokenizer, loaded.model.config.vocab_size),
    )
    adapter, adapter_id, keep = None, None, None
    if args.target:
        adapter, adapter_id, keep = _pairing_for_export(loaded.name, tokenizer, token_bytes, args)
    prompts = [
        tokenizer(p)["input_ids"]
        for p in load_prompts("gsm8k", max(1, args.parity_prompts // 2))
        + load_prompts("humaneval", max(1, args.parity_prompts - args.parity_prompts // 2))
    ][: args.parity_prompts]
    sidecar = export_drafter(
        loaded.model,
        args.out,
        name=loaded.name,
        tokenizer=tokenizer,
        fingerprint=token_bytes.fingerprint,
        adapter=MergedAdapter(adapter, config_from_state(adapter), adapter_id) if adapter else None,
        options=ExportOptions(
            quantize=args.quantize,
            keep_ids=keep,
            parity_prompts=prompts or None,
            head=args.head or ("outside" if args.exporter == "optimum" else "inside"),
            exporter=args.exporter,
            optimum_python=args.optimum_python,
        ),
    )
    shown = {k: v for k, v in sidecar.items() if k != "keep_ids"}
    shown["kept_tokens"] = len(sidecar["keep_ids"]) if sidecar["keep_ids"] else None
    print(json.dumps(shown, indent=1))


def _pairing_for_export(
    drafter_name: str, tokenizer: Any, token_bytes: Any, args: argparse.Namespace
) -> tuple:
    """(adapter tensors, adapter id, kept token ids) of the (drafter, target, user) profile for export."""
    import omnidraft as od

    from ..store.profiles import SHARED_USER, ProfileStore
    from ..translate.vocab_map import build_vocab_map

    target = od.LocalTarget.load(args.target, kernels=False)
    fingerprint = f"{token_bytes.fingerprint}:{target.token_bytes.fingerprint}"
    profile = ProfileStore().load(
        drafter_name, target.name, args.user or SHARED_USER, fingerprint=fingerprint
    )
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
    from ..optional import require

    uvicorn = require("uvicorn", "omnidraft serve")
    require("fastapi", "omnidraft serve")

    from ..server.app import ServerConfig, create_app, http_protocol
    from ..server.drain import DrainingServer
    from ..targets.registry import engine, resolved

    key = api_keys(args)
    config = ServerConfig(
        api_key=key,
        operator_key=operator_key(args),
        max_sessions=args.max_sessions,
        ttl_s=args.ttl,
        max_sessions_per_key=args.max_sessions_per_key,
        log_requests=args.log_requests,
        adapters_dir=args.share_adapters,
        adapter_min_keys=args.adapter_min_keys,
    )
    if args.log_requests:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        requests_log = logging.getLogger("omnidraft.requests")
        requests_log.addHandler(handler)
        requests_log.setLevel(logging.INFO)
        requests_log.propagate = False
    try:
        name = resolved(args.target, args.engine, vars(args))
        target = engine(name).load(args.target, vars(args))
    except ValueError as exc:
        raise SystemExit(f"omnidraft serve: {exc}") from None
    chosen = " (the fastest engine here)" if args.engine == "auto" else ""
    print(
        f"omnidraft serve: {target.name} on {name}{chosen} at http://{args.host}:{args.port} - device "
        "sessions at "
        "/v1/sessions, OpenAI clients at /v1/models, /v1/completions, /v1/chat/completions; API key "
        f"{'required' if key else 'OFF'}",
        file=sys.stderr,
        flush=True,
    )
    # on SIGTERM the server drains (server/drain.py): /ready turns 503, new work is refused, what
    # runs finishes; it exits 0 once quiet for QUIET_S, or at GRACE_S
    app = create_app(target, config)
    settings = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACE_S,
        http=http_protocol(),
    )
    DrainingServer(settings, app.state.drain, deadline_s=GRACE_S, quiet_s=QUIET_S).run()


GRACE_S = 30  # seconds a draining server lets what runs finish
QUIET_S = 2.0  # a draining server with nothing running for this long exits


def api_keys(args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """The server's key(s): --api-key-file (one per line), else $OMNIDRAFT_API_KEY (comma-separated),
    else none with --no-auth; without any of them serve refuses to start."""
    import os

    if args.api_key_file is not None:
        keys, where = key_lines(args.api_key_file), args.api_key_file
    elif os.environ.get(KEY_ENV):
        keys, where = env_keys(), f"${KEY_ENV}"
    elif args.no_auth:
        return None
    else:
        raise SystemExit(
            f"serve needs --api-key-file FILE or ${KEY_ENV} (or --no-auth for a loopback-only "
            "development server)"
        )
    if not keys:
        raise SystemExit(
            f"{where} is empty: put the API key in it (several: one per line, or comma-separated)"
        )
    return keys[0] if len(keys) == 1 else keys


def key_lines(path: str) -> tuple[str, ...]:
    """The keys a key file holds: its non-empty lines, stripped."""
    return tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())


def operator_key(args: argparse.Namespace) -> str | None:
    """The operator's key, from --operator-key-file (its first non-empty line), or None."""
    if args.operator_key_file is None:
        return None
    lines = key_lines(args.operator_key_file)
    if not lines:
        raise SystemExit(f"{args.operator_key_file} is empty: put the operator key in it")
    return lines[0]


def _profiles(args: argparse.Namespace) -> None:
    from ..store.profiles import ProfileStore

    store = ProfileStore(args.store)
    if args.action == "list":
        for p in store.entries():
            print(
                f"{p.drafter} -> {p.target}  user {p.user!r}  steps {p.steps}  "
                f"history {sum(map(len, (p.history or {}).get('docs', [])))} tokens"
            )
        return
    if args.action != "import" and args.user is None:
        raise SystemExit(f"profiles {args.action} needs --user")
    if args.action == "show":
        profile = store.load(args.drafter, args.target, args.user)
        if profile is None:
            raise FileNotFoundError(f"no profile for user {args.user!r} of {args.drafter} -> {args.target}")
        print(
            json.dumps(
                {
                    "drafter": profile.drafter,
                    "target": profile.target,
                    "user": profile.user,
                    "steps": profile.steps,
                    "tensors": sorted(profile.tensors),
                    "metrics": profile.metrics[-3:],
                },
                indent=1,
            )
        )
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
    from ..errors import MissingModelError
    from ..store.presets import PRESETS, require_installed
    from .doctor import clear_cache, report, reset

    if args.reset or args.clear_cache:
        print("\n".join((reset() if args.reset else []) + (clear_cache() if args.clear_cache else [])))
        return
    drafter = None if args.drafter == "none" else args.drafter
    if drafter in PRESETS:
        try:
            require_installed(PRESETS[drafter])
        except MissingModelError:  # its line above says how to install it
            drafter = None
    print("\n".join(report(args.target, drafter)), flush=True)


def _simulate(args: argparse.Namespace) -> None:
    from ..device_sim.__main__ import main as simulate_main

    simulate_main(args.rest)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # every argument, --help included, is device_sim's
        from ..device_sim.__main__ import main as simulate_main

        simulate_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    start_run(args)
    from ..bench.commands import bench

    commands = {
        "generate": _generate,
        "demo": _demo,
        "bench": bench,
        "export": _export,
        "serve": _serve,
        "deploy": deploy,
        "simulate": _simulate,
        "doctor": _doctor,
        "profiles": _profiles,
    }
    try:
        commands[args.command](args)
    except (
        OmnidraftError,
        ValueError,
        OSError,
    ) as exc:  # the user's input or environment: one line, no traceback
        if args.debug:
            raise
        raise SystemExit(f"omnidraft {args.command}: error: {exc} (--debug shows the traceback)") from None
