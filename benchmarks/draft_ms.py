"""ms per drafted token of drafting backends, the drafter alone (no target): 32-token greedy drafts
after a 200-token GSM8K prompt, median of 5, `--passes` passes, one backend after another in one
process (docs/onnx.md, "Any architecture, through optimum"). `--adapter`: each PyTorch drafter also
with a LoRA adapter that acts (AdapterConfig's defaults, B drawn small), drafting merged into its
projections (distill/merged.py) and through peft's LoRA layers (docs/personalization.md).

    python -m benchmarks.draft_ms --onnx "optimum fp32=gemma.onnx" --model "PyTorch int8=gemma3-270m:torch" \\
        --model "llama.cpp=gemma3-270m:llama.cpp"
"""

from __future__ import annotations

import argparse
import gc
import json


def main() -> None:
    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts
    from omnidraft.runtime.backends import draft_ms

    p = argparse.ArgumentParser(prog="python -m benchmarks.draft_ms")
    p.add_argument("--onnx", action="append", default=[], help="LABEL=FILE.onnx (repeatable)")
    p.add_argument("--model", action="append", default=[], help="LABEL=PRESET:BACKEND (repeatable)")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--adapter", action="store_true", help="PyTorch drafters also with an adapter")
    args = p.parse_args()
    rows: dict[str, object] = {}
    text = " ".join(load_prompts("gsm8k", 3))
    specs = [(*item.split("=", 1), {}) for item in args.onnx] + [
        (label, spec.rsplit(":", 1)[0], {"backend": spec.rsplit(":", 1)[1]})
        for label, spec in (item.split("=", 1) for item in args.model)
    ]
    for label, spec, options in specs:
        drafter = od.Drafter.load(spec, **options)
        prompt = drafter.tokenizer(text)["input_ids"][:200]
        runs = [(label, None)]
        if args.adapter and drafter.learns:
            _an_adapter_that_acts(drafter)
            runs += [(f"{label} + adapter, merged", True), (f"{label} + adapter, LoRA layers", False)]
        for name, merge in runs:
            if len(runs) > 1:  # (the bare row first: no adapter active)
                drafter.activate(None if merge is None else "acts")
                drafter.merge_adapters = merge is not False
            rows[name] = [round(draft_ms(drafter, prompt, tokens=32, reps=5), 1) for _ in range(args.passes)]
            print(name, rows[name], flush=True)
        del drafter
        gc.collect()
    print(json.dumps(rows, indent=1))


def _an_adapter_that_acts(drafter: object) -> None:
    import torch

    from omnidraft.distill.adapters import AdapterConfig

    drafter.add_adapter("acts", AdapterConfig())  # type: ignore[attr-defined]
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.trainable.named_parameters():  # type: ignore[attr-defined]
            if "lora_B" in name:
                p.normal_(0.0, 0.002)


if __name__ == "__main__":
    main()
