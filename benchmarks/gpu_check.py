"""The prepared GPU measurement: a target's decoding step and verify costs on an accelerator, from
model shapes alone (docs/gpu.md).

    python -m benchmarks.gpu_check --device cuda --out gpu-check.json          # on the GPU machine
    python -m omnidraft.device_sim gpu-profile gpu-check.json --out gpu-profiles.json    # then, anywhere

Each model is built from its `config.json` (benchmarks/gpu_configs/) with random weights: weights
cannot travel to the lent machine and timing does not depend on their values. For each shape, in
bf16: a forward over k = 1, 2, 4, 8, 16 new tokens (k = 1: one decoding step) after 200, 1,000
and 4,000 tokens of context, eager (dynamic KV cache) and graph-captured (omnidraft's StaticRunner:
a static KV cache replaying CUDA graphs, what LocalTarget verifies with); for the shapes named by
--compile also gpt-fast's way (static cache under `torch.compile(mode="reduce-overhead")`); HF
`generate` alone as the baseline step. Imports torch, transformers and omnidraft.runtime.static_runner.
One JSON out, rewritten after each shape so that a run cut short keeps what it measured.
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
    return build_from(CONFIGS / f"{name}.json", device, dtype, layers)


def build_from(config_path: Path, device: torch.device, dtype: torch.dtype, layers: int | None = None) -> Any:
    """A causal LM of the shape in `config_path` (a config.json) with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    doc = json.loads(config_path.read_text())
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
                cache.crop(-k)  # back to the context

            row[str(k)] = round(median_ms(step, device, reps), 3)
        out[str(context)] = row
    return out


@torch.inference_mode()
def graphs(model: Any, contexts: list[int], ks: list[int], device: torch.device, reps: int) -> dict[str, Any]:
    """The same forwards through omnidraft's StaticRunner (what LocalTarget verifies with on a GPU):
    a static cache whose feeds of up to 16 tokens replay a CUDA graph captured once per shape."""
    from omnidraft.runtime.static_runner import StaticRunner

    vocab = model.config.vocab_size
    runner = StaticRunner(model, [], capacity=max(contexts) + max(ks) + 1, graphs=device.type == "cuda")
    out: dict[str, Any] = {}
    for context in contexts:
        runner.reset(_ids(context, vocab, device)[0].tolist())
        runner.forward(keep=1)  # the prefill, eager
        row = {}
        for k in ks:
            new = (_ids(k, vocab + 1, device) % vocab)[0].tolist()

            def step(new: list[int] = new, k: int = k, context: int = context) -> None:
                runner.extend(new)
                runner.forward(keep=k)
                runner.crop(context)

            step()  # the capture itself is not timed
            row[str(k)] = round(median_ms(step, device, reps), 3)
        out[str(context)] = row
    if runner.graph_error:
        out["error"] = runner.graph_error
    return out


@torch.inference_mode()
def compiled(
    model: Any, contexts: list[int], ks: list[int], device: torch.device, reps: int
) -> dict[str, Any]:
    """gpt-fast's way for comparison: a static cache under torch.compile(mode="reduce-overhead"),
    which fuses kernels as well as capturing graphs; it compiles once per k (not timed)."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=max(contexts) + max(ks))
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    out: dict[str, Any] = {}
    for context in contexts:
        cache.reset()
        model(input_ids=_ids(context, vocab, device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        row = {}
        for k in ks:
            new = _ids(k, vocab + 1, device) % vocab
            where = torch.arange(context, context + k, device=device)[None]

            def step(new: torch.Tensor = new, where: torch.Tensor = where, k: int = k) -> None:
                for layer in cache.layers:  # layers write at their own position: back to the context
                    layer.cumulative_length.fill_(context)
                forward(
                    input_ids=new, position_ids=where, past_key_values=cache, use_cache=True, logits_to_keep=k
                )

            step()  # the compilation and capture are not timed
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


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def check(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "device": args.device,
        "dtype": args.dtype,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "contexts": args.contexts,
        "ks": args.ks,
        "layers": args.layers,
        "models": {},
    }
    started = time.perf_counter()

    def done(name: str, row: dict[str, Any]) -> None:
        report["models"][name] = row
        print(name, json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))  # what is done so far survives a timeout
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for name in args.models:
        model = build(name, device, dtype, args.layers)
        row: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
        row["eager"] = eager(model, args.contexts, args.ks, device, args.reps)
        row["generate_ms_per_token"] = round(
            generate_ms_per_token(model, device, min(args.contexts), args.reps), 3
        )
        if args.graphs:
            try:
                row["graph"] = graphs(model, args.contexts, args.ks, device, args.reps)
            except Exception as exc:  # recorded, not fatal: the eager figures stand
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
        del model
        done(name, row)
    for name in (n for n in args.models if n in args.compile):  # last: compiling is the slow part
        if time.perf_counter() - started > args.budget_s:
            report["models"][name]["compiled_error"] = f"not started: past --budget-s {args.budget_s}"
            continue
        model = build(name, device, dtype, args.layers)
        try:
            report["models"][name]["compiled"] = compiled(model, args.contexts, args.ks, device, args.reps)
        except Exception as exc:
            report["models"][name]["compiled_error"] = f"{type(exc).__name__}: {exc}"[:500]
        del model
        done(name, report["models"][name])
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
        "--compile",
        nargs="*",
        default=["qwen2.5-0.5b"],
        choices=MODELS,
        help="shapes also measured under torch.compile (slow to compile; none: --compile)",
    )
    p.add_argument(
        "--budget-s", type=float, default=240.0, help="no compilation starts after this many seconds"
    )
    p.add_argument("--out", default="gpu-check.json")
    args = p.parse_args(argv)
    report = check(args)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
