"""The prepared batched step check: what one engine step costs by the rows in it and the tokens per
row, the input of device_sim's capacity model (docs/gpu.md, "Capacity").

    python -m benchmarks.step_profile --device cuda --out step-profile.json             # the GPU
    python -m benchmarks.step_profile --device cpu --models qwen2.5-0.5b --dtype float32 \\
        --rows 1 2 4 8 --tokens 1 2 4 9 --contexts 200 --out step-profile-cpu.json       # this CPU

Each model is built from its shape (benchmarks/gpu_configs/, or --config) with random weights, as
benchmarks/gpu_check.py does. For each context, each row count and each number of new tokens per
row: one forward over `rows` sequences that each hold `context` tokens of KV cache (filled with
random values, not prefilled: the values do not change the time) and `tokens` new ones, logits for
every new token (a verify needs them all), timed as the median of --reps after a warm-up; the cache
is cropped back after each. Rows whose KV cache would not fit in the device's free memory are
skipped and recorded as such. Points run smallest first and the JSON is rewritten after each row
count, so a run cut short by --budget-s (or a timeout) keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from .gpu_check import CONFIGS, MODELS, _sync, build_from, device_name, median_ms

FORMAT, VERSION = "omnidraft-step-profile", 1


def kv_shape(config: Any) -> tuple[int, int]:
    """(KV heads, head dimension) of a model config."""
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or (
        config.hidden_size // heads
    )


def kv_bytes(config: Any, rows: int, context: int, dtype: torch.dtype) -> int:
    kv_heads, dim = kv_shape(config)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * rows * kv_heads * context * dim * size


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**34


def filled_cache(model: Any, rows: int, context: int) -> Any:
    """A DynamicCache of `rows` sequences of `context` tokens, every layer's K and V random."""
    from transformers import DynamicCache

    config, param = model.config, next(model.parameters())
    kv_heads, dim = kv_shape(config)
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(rows, kv_heads, context, dim, device=param.device, dtype=param.dtype)
        cache.update(k, torch.randn_like(k), layer)
    return cache


@torch.inference_mode()
def time_step(model: Any, cache: Any, rows: int, context: int, tokens: int, reps: int) -> float:
    """ms of one forward over `rows` x `tokens` new tokens after `context` cached ones per row."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(rows * 1000 + tokens)
    new = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=gen).to(device)
    where = torch.arange(context, context + tokens, device=device).expand(rows, tokens)

    def step() -> None:
        model(input_ids=new, position_ids=where, past_key_values=cache, use_cache=True, logits_to_keep=tokens)
        cache.crop(-tokens)  # back to the context

    return round(median_ms(step, device, reps), 3)


def profile(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "device": args.device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "rows": args.rows,
        "tokens": args.tokens,
        "contexts": args.contexts,
        "models": {},
    }
    started = time.perf_counter()
    configs = [(Path(args.config).stem, Path(args.config))] if args.config else []
    configs += [(name, CONFIGS / f"{name}.json") for name in ([] if args.config else args.models)]
    for name, path in configs:
        model = build_from(path, device, dtype)
        row: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()), "contexts": {}}
        report["models"][name] = row
        for context in args.contexts:
            table: dict[str, Any] = {}
            row["contexts"][str(context)] = table
            for rows in args.rows:
                if time.perf_counter() - started > args.budget_s:
                    table[str(rows)] = f"not measured: past --budget-s {args.budget_s}"
                    continue
                if kv_bytes(model.config, rows, context + max(args.tokens), dtype) > 0.8 * _free_bytes(
                    device
                ):
                    table[str(rows)] = "not measured: the KV cache would not fit"
                    continue
                cache = filled_cache(model, rows, context)
                _sync(device)
                table[str(rows)] = {
                    str(t): time_step(model, cache, rows, context, t, args.reps) for t in args.tokens
                }
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(name, context, rows, json.dumps(table[str(rows)]), flush=True)
                Path(args.out).write_text(json.dumps(report, indent=1))  # a cut run keeps what it has
        del model
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def from_vllm_measurements(model: str, threads: int = 1) -> dict[str, Any]:
    """A step profile of the vLLM engine as this machine measured it when it first served `model`
    on `threads` threads (`VLLMTarget`'s kept verify costs of 1-8 tokens on one row and batch costs
    of 16 rows of 1, 4 and 8 tokens: runtime/measured.py), at the context those use."""
    from omnidraft.runtime import measured
    from omnidraft.targets.vllm_costs import BATCH_ROWS, COST_CONTEXT

    torch.set_num_threads(threads)  # (a measurement is kept per machine and thread count)

    def entry(kind: str) -> dict[str, float]:
        found = [v for k, v in measured.read(kind).items() if k.split("|")[0] == model]
        if not found:
            raise SystemExit(f"no {kind} measured for {model} on this machine: serve it on vLLM once first")
        return {str(k): float(v) for k, v in found[0].items()}

    verify, batch = entry("vllm-verify-costs"), entry("vllm-batch-costs")
    per_row = {int(total) // BATCH_ROWS: ms for total, ms in batch.items()}
    tokens = sorted(t for t in per_row if str(t) in verify)
    return {
        "format": FORMAT,
        "version": VERSION,
        "device": "cpu",
        "device_name": f"{device_name(torch.device('cpu'))}, vLLM's CPU engine",
        "torch": torch.__version__,
        "dtype": "float32",
        "rows": [1, BATCH_ROWS],
        "tokens": tokens,
        "contexts": [COST_CONTEXT],
        "models": {
            model: {
                "source": "VLLMTarget's kept verify_costs and batch_costs (runtime/measured.py)",
                "contexts": {
                    str(COST_CONTEXT): {
                        "1": {str(t): round(1e3 * verify[str(t)], 3) for t in tokens},
                        str(BATCH_ROWS): {str(t): round(1e3 * per_row[t], 3) for t in tokens},
                    }
                },
            }
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--config", default=None, help="a config.json of another shape (instead of --models)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 5, 9])
    p.add_argument("--contexts", nargs="+", type=int, default=[200, 1000, 4000])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=420.0, help="no row count starts after this many s")
    p.add_argument("--out", default="step-profile.json")
    p.add_argument(
        "--from-vllm",
        metavar="MODEL",
        default=None,
        help="write the profile of vLLM's engine as this machine measured it serving MODEL (no timing)",
    )
    p.add_argument("--threads", type=int, default=1, help="with --from-vllm: the server's threads")
    args = p.parse_args(argv)
    if args.from_vllm:
        Path(args.out).write_text(json.dumps(from_vllm_measurements(args.from_vllm, args.threads), indent=1))
        print(f"wrote {args.out}")
        return
    if min(args.rows) < 1 or min(args.tokens) < 1 or min(args.contexts) < 1:
        raise SystemExit("--rows, --tokens and --contexts must be >= 1")
    report = profile(args)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
