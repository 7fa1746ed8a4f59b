"""The prepared GPU measurement: a target's decoding step and verify costs on an accelerator, from
model shapes alone (docs/gpu.md).

    python -m benchmarks.gpu_check --device cuda --out gpu-check.json          # on the GPU machine
    python -m device_sim gpu-profile gpu-check.json --out gpu-profiles.json    # then, anywhere

Each model is built from its `config.json` (benchmarks/gpu_configs/) with random weights: weights
cannot travel to the lent machine and timing does not depend on their values. For each shape, in
bf16: one decoding step, and a forward over k = 1, 2, 4, 8, 16 new tokens after 200, 1,000 and
4,000 tokens of context, eager (dynamic KV cache) and graph-captured (static KV cache under
`torch.compile(mode="reduce-overhead")`, i.e. CUDA graphs); HF `generate` alone as the baseline
step. Only torch and transformers are imported (the lent machine has nothing else). One JSON out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT, VERSION = "omnidraft-gpu-check", 1
CONFIGS = Path(__file__).with_name("gpu_configs")
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall time of `fn` in milliseconds, after one warm-up call, the device synchronised."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def build(name: str, device: torch.device, dtype: torch.dtype, layers: int | None) -> Any:
    """A causal LM of `name`'s shape with random weights, on `device` in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    doc = json.loads((CONFIGS / f"{name}.json").read_text())
    if layers is not None:
        doc["num_hidden_layers"] = layers
    config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def _ids(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(device)


@torch.inference_mode()
def eager(model: Any, contexts: list[int], ks: list[int], device: torch.device, reps: int) -> dict[str, Any]:
    """ms of a forward over k new tokens after each context (dynamic cache, cropped back each time)."""
    from transformers import DynamicCache

    vocab, out = model.config.vocab_size, {}
    for context in contexts:
        cache = DynamicCache()
        started = time.perf_counter()
        model(input_ids=_ids(context, vocab, device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill = 1e3 * (time.perf_counter() - started)
        row = {"prefill_ms": round(prefill, 3)}
        for k in ks:
            new = _ids(k, vocab + 1, device) % vocab

            def step(new: torch.Tensor = new, k: int = k) -> None:
                model(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=k)
                cache.crop(context)

            row[str(k)] = round(median_ms(step, device, reps), 3)
        out[str(context)] = row
    return out


@torch.inference_mode()
def graphs(model: Any, contexts: list[int], ks: list[int], device: torch.device, reps: int) -> dict[str, Any]:
    """The same forwards on a static cache, compiled with mode="reduce-overhead" (CUDA graphs), one
    graph per k; positions past the context are rewritten by each call, so nothing is cropped."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=max(contexts) + max(ks))
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    out: dict[str, Any] = {}
    for context in contexts:
        cache.reset()
        model(
            input_ids=_ids(context, vocab, device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=torch.arange(context, device=device),
        )
        row = {}
        for k in ks:
            new, where = _ids(k, vocab + 1, device) % vocab, torch.arange(context, context + k, device=device)

            def step(new: torch.Tensor = new, where: torch.Tensor = where, k: int = k) -> None:
                forward(
                    input_ids=new,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=k,
                    cache_position=where,
                )

            step()  # the capture itself is not timed
            row[str(k)] = round(median_ms(step, device, reps), 3)
        out[str(context)] = row
    return out


@torch.inference_mode()
def generate_ms_per_token(model: Any, device: torch.device, context: int, reps: int) -> float:
    """HF `generate` alone (greedy, its default cache): ms per token past the first."""
    ids = _ids(context, model.config.vocab_size, device)

    def run(n: int) -> None:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    return (median_ms(lambda: run(33), device, reps) - median_ms(lambda: run(1), device, reps)) / 32


def check(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "device": args.device,
        "dtype": args.dtype,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "contexts": args.contexts,
        "ks": args.ks,
        "layers": args.layers,
        "models": {},
    }
    started = time.perf_counter()
    for name in args.models:
        model = build(name, device, dtype, args.layers)
        row: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
        row["eager"] = eager(model, args.contexts, args.ks, device, args.reps)
        row["generate_ms_per_token"] = round(
            generate_ms_per_token(model, device, min(args.contexts), args.reps), 3
        )
        if args.graphs and time.perf_counter() - started < args.budget_s:
            try:
                row["graph"] = graphs(model, args.contexts, args.ks, device, args.reps)
            except Exception as exc:  # recorded, not fatal: the eager figures stand
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
        report["models"][name] = row
        print(name, json.dumps(row), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--contexts", nargs="+", type=int, default=[200, 1000, 4000])
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the shape has (a quick CPU run)"
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument(
        "--budget-s", type=float, default=240.0, help="no graph capture starts after this many seconds"
    )
    p.add_argument("--out", default="gpu-check.json")
    args = p.parse_args(argv)
    report = check(args)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
