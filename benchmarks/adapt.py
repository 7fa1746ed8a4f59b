"""`python -m benchmarks adapt`: does online distillation make a pairing faster? Measured, not assumed.

1. Record the target once per prompt (trace_store, batched): its greedy continuation and top-k
   log-probabilities. Cached beside the results, so a rerun or another variant costs no target time.
2. Evaluate: the full engine (drafter, translator, session) against a `ReplayTarget` of the held-out
   traces: exact greedy acceptance, τ and n-gram hits with drafter forwards only.
3. Train each variant online (Algorithm 2) on the training traces in order: every `interval`
   requests the buffer becomes optimizer steps. In greedy mode a request's committed tokens and
   target rows do not depend on the drafter, so a trace gives exactly the example a live request
   would; only EvoSpec position weights would need the live round structure (not used here).
4. Evaluate after every `eval_every` steps (curve) and at the end (before/after table, PNG).

Variants (the paper's ablation): none, dm (KL only, LoRA), hybrid (KL + λ·NLL, LoRA), full (KL +
λ·NLL, full fine-tuning of the fp32 drafter, re-quantized to int8 for drafting); and ours: spans
(hybrid, with the NLL also on misaligned runs of target tokens, see distill/buffer.py, and on the
committed token at direct positions: TrainConfig.direct_nll) and full-spans (spans' loss, full
fine-tuning). Full fine-tuning moves every weight, so it takes its own learning rate (`full_lr`).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from omnidraft.distill.buffer import build_example
from omnidraft.distill.trace_store import ReplayTarget, TargetTrace
from omnidraft.distill.trainer import OnlineTrainer, TrainConfig
from omnidraft.runtime.int8 import quantize_int8
from omnidraft.store.models import load_model
from omnidraft.translate.ngram_cache import NgramCache, NgramCacheConfig
from omnidraft.translate.vocab_map import build_vocab_map

from .adapt_eval import MARGINS, agreement, evaluate, prompts_for, request_of, traces_for
from .adapt_report import FULL, NO_GAIN, write_report

__all__ = [
    "FULL",
    "MARGINS",
    "VARIANTS",
    "agreement",
    "cache_ablation",
    "evaluate",
    "live_check",
    "prompts_for",
    "run_adapt",
    "traces_for",
]

log = logging.getLogger("omnidraft")

VARIANTS = {  # the paper's (dm, hybrid, full) on its own labels and losses; spans: what learning pairings do
    "none": None,
    "dm": {"ngram_loss": "none", "spans": False, "direct_nll": 0.0},
    "hybrid": {"spans": False, "direct_nll": 0.0},
    "spans": {"spans": True},
    "full": {"spans": False, "direct_nll": 0.0},
    "full-spans": {"spans": True},
}


def run_adapt(
    drafter: Any,
    target: Any,
    *,
    train: str,
    evaluation: str,
    n_train: int,
    n_eval: int,
    max_new_tokens: int,
    steps: int,
    eval_every: int,
    variants: list[str],
    config: TrainConfig,
    rank: int,
    k: int,
    stop_confidence: float,
    out: Path,
    name: str,
    modules: tuple[str, ...] | None = None,
    cache_study: bool = False,
    record_batch: int = 8,
    live: int = 0,
    full_lr: float | None = None,
    tts: TrainConfig | None = None,
    eval_max_new_tokens: int | None = None,
    on_point: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the experiment of the module doc; write `name`.json/.md/.png under `out`. Traces not yet
    cached are recorded `record_batch` prompts at a time. `live` > 0: the unadapted and each
    adapted drafter also run on the first `live` held-out prompts against the live `target`, beside
    their replayed figures on the same prompts (result["live"]). `full_lr`: the learning rate of the
    full fine-tuning variants (default: config's, the adapters'). `tts` (a config with `tts_every` > 0):
    the unadapted drafter (on a fresh adapter) and each LoRA variant are also scored with Test-Time
    Speculation, which needs long held-out requests to show anything: `eval_max_new_tokens` records
    the held-out traces longer than the training ones (default: `max_new_tokens`)."""
    from omnidraft.distill.adapters import AdapterConfig
    from omnidraft.draft.torch_drafter import TorchDrafter as Drafter

    out.mkdir(parents=True, exist_ok=True)
    train_traces = traces_for(target, train, n_train, max_new_tokens, out, batch_size=record_batch)
    eval_traces = traces_for(
        target, evaluation, n_eval, eval_max_new_tokens or max_new_tokens, out, batch_size=record_batch
    )
    replay = ReplayTarget.like(target, train_traces + eval_traces)
    train_prompts = prompts_for(target, train, train_traces)
    eval_prompts = prompts_for(target, evaluation, eval_traces)
    lora = AdapterConfig(rank=rank, alpha=2 * rank, **({"modules": tuple(modules)} if modules else {}))
    t2d = build_vocab_map(drafter.token_bytes, target.token_bytes, drafter.tokenizer, target.tokenizer).t2d
    score = lambda d, adapter=None, stop=stop_confidence, tts=None: evaluate(  # noqa: E731
        d, replay, eval_traces, eval_prompts, k=k, stop_confidence=stop, adapter=adapter, tts=tts
    )
    result: dict[str, Any] = {
        "pair": f"{drafter.name}:{target.name}",
        "train": train,
        "eval": evaluation,
        "n_train": len(train_traces),
        "n_eval": len(eval_traces),
        "max_new_tokens": max_new_tokens,
        "eval_max_new_tokens": eval_max_new_tokens or max_new_tokens,
        "k": k,
        "stop_confidence": stop_confidence,
        "rank": rank,
        "drafter_precision": "int8" if getattr(drafter, "int8", False) else "fp32",
        "train_weights": "drafting" if getattr(drafter, "_through_int8", False) else "fp32",
        "modules": list(lora.modules),
        "config": dict(vars(config)),
        "variants": {},
    }
    baseline = result["baseline"] = score(drafter)
    agree = lambda d, adapter=None: agreement(d, adapter, target.token_bytes, t2d, eval_traces, eval_prompts)  # noqa: E731
    result["agreement"] = agree(drafter)
    check = lambda d, adapter=None: live_check(
        d,
        adapter,
        target,
        replay,
        eval_traces[:live],
        eval_prompts[:live],  # noqa: E731
        k=k,
        stop_confidence=stop_confidence,
    )
    if live:
        result["live"] = {"prompts": min(live, len(eval_traces)), "variants": {"none": check(drafter)}}
    on_point({"variant": "none", "step": 0, **baseline})
    # The engine's early stop drafts less where the drafter is unsure, and an adapted drafter is sure
    # more often, so it drafts more per round: its per-round acceptance understates how much closer it
    # came to the target. The paper measures at a fixed draft length; so does this second figure.
    fixed = stop_confidence > 0
    if fixed:
        result["baseline_fixed_k"] = score(drafter, stop=0.0)
    settings = {"early stop": stop_confidence, "fixed k": 0.0} if stop_confidence > 0 else {"fixed k": 0.0}
    with_tts = lambda d, adapter: {
        name: score(d, adapter, stop=stop, tts=tts) for name, stop in settings.items()
    }  # noqa: E731
    if tts is not None:
        result["tts"] = {"every": tts.tts_every, "lr": tts.tts_lr}
        torch.manual_seed(config.seed)
        fresh = f"adapt_tts_none_{time.time_ns()}"
        drafter.add_adapter(fresh, lora)
        result["baseline_tts"] = with_tts(drafter, fresh)
    if cache_study:
        result["cache_ablation"] = cache_ablation(
            drafter, target, eval_traces, eval_prompts, k=k, stop_confidence=stop_confidence
        )
        write_report(out, name, result)
    for variant in variants:
        if variant == "none":
            result["variants"]["none"] = {
                "curve": [{"step": 0, **baseline}],
                "final": {"step": 0, **baseline},
            }
            if fixed:
                result["variants"]["none"]["fixed_k"] = result["baseline_fixed_k"]
            if tts is not None:
                result["variants"]["none"]["tts"] = result["baseline_tts"]
            continue
        cfg = replace(
            config,
            **VARIANTS[variant],
            **({"lr": full_lr} if variant in FULL and full_lr is not None else {}),
        )
        torch.manual_seed(
            cfg.seed
        )  # the LoRA's random A: two unseeded runs ended 0.016-0.025 apart in acceptance
        if variant in FULL:
            if drafter.int8:
                model = load_model(drafter.spec).model
            else:  # the fp32 base without any adapter layers
                model = (
                    copy.deepcopy(drafter.trainable).unload()
                    if drafter.trainable is not None
                    else copy.deepcopy(drafter.model)
                )
            model.requires_grad_(True)
            trainer = OnlineTrainer(model, t2d, cfg)
            drafting = (lambda m: quantize_int8(m, drafter.tokenizer)) if drafter.int8 else copy.deepcopy  # noqa: E731
            as_drafter = lambda: (Drafter(drafting(model.eval()), drafter.tokenizer, drafter.name), None)  # noqa: E731
        else:
            adapter = f"adapt_{variant}_{time.time_ns()}"
            drafter.add_adapter(adapter, lora)
            trainer = OnlineTrainer(drafter.learner, t2d, cfg, step_lock=drafter.lock)
            as_drafter = lambda adapter=adapter: (drafter, adapter)  # noqa: E731
        curve = [{"step": 0, **baseline}]
        started, i = time.perf_counter(), 0
        while trainer.steps < steps and i < 50 * len(
            train_traces
        ):  # (a set with no labelled token never steps)
            trace, prompt = train_traces[i % len(train_traces)], train_prompts[i % len(train_traces)]
            i += 1
            if variant not in FULL:
                drafter.activate(as_drafter()[1])
            if trainer.add(
                build_example(
                    request_of(trace, prompt, cfg.topk), drafter, target.token_bytes, t2d, spans=cfg.spans
                )
            ):
                before = trainer.steps
                logs = trainer.update()
                log.info(
                    "%s: step %d, loss %.3f (%.0f s)",
                    variant,
                    trainer.steps,
                    logs[-1]["loss"] if logs else float("nan"),
                    time.perf_counter() - started,
                )
                if trainer.steps // eval_every > before // eval_every or trainer.steps >= steps:
                    point = {
                        "step": trainer.steps,
                        "requests": i,
                        "loss": logs[-1]["loss"] if logs else None,
                        **score(*as_drafter()),
                    }
                    curve.append(point)
                    on_point({"variant": variant, **point})
        result["variants"][variant] = {
            "curve": curve,
            "final": curve[-1],
            "lr": cfg.lr,
            "train_s": time.perf_counter() - started,
            "requests": i,
            "trained_bytes": sum(p.numel() * p.element_size() for p in trainer.params),
        }
        trained = as_drafter()  # (a full variant's drafter is built once, for every figure below)
        if fixed:
            result["variants"][variant]["fixed_k"] = score(*trained, stop=0.0)
        result["variants"][variant]["agreement"] = agree(*trained)
        if live:
            result["live"]["variants"][variant] = check(*trained)
        if variant not in FULL:
            result["variants"][variant]["profile"] = profile_footprint(drafter, target, adapter)
            drafter.merge_adapters = False  # the same adapter drafting through peft's LoRA layers
            try:
                result["variants"][variant]["through_lora"] = score(drafter, adapter)
            finally:
                drafter.merge_adapters = True
            if tts is not None:  # (a fully tuned drafter has no adapter for the fast steps to move)
                result["variants"][variant]["tts"] = with_tts(drafter, adapter)
        write_report(out, name, result)
    write_report(out, name, result)
    return result


def live_check(
    drafter: Any,
    adapter: str | None,
    target: Any,
    replay: ReplayTarget,
    traces: list[TargetTrace],
    prompts: list[str],
    *,
    k: int,
    stop_confidence: float,
) -> dict[str, dict[str, Any]]:
    """The figures replay gives, beside those of the live `target` on the same prompts: with the
    engine's early stop and (if it has one) at a fixed draft length. They agree wherever the live
    greedy output is the recorded one; a recording batched several prompts per forward, whose
    rounding can tip a near tie the other way ("same_as_recorded" counts the prompts that match)."""
    settings = {"early stop": stop_confidence, "fixed k": 0.0} if stop_confidence > 0 else {"fixed k": 0.0}
    run = lambda t, stop: evaluate(drafter, t, traces, prompts, k=k, stop_confidence=stop, adapter=adapter)  # noqa: E731
    return {name: {"replay": run(replay, stop), "live": run(target, stop)} for name, stop in settings.items()}


def profile_footprint(drafter: Any, target: Any, adapter: str) -> dict[str, int]:
    """Bytes of a pairing profile holding `adapter`: on disk (every file of the saved version, with
    an empty n-gram cache: the cache's own size is measured by `evaluate` as `ngram_bytes`) and in
    RAM (the adapter's tensors)."""
    import tempfile

    from omnidraft.distill.adapters import adapter_state
    from omnidraft.store.profiles import PairingProfile, ProfileStore

    tensors = adapter_state(drafter.trainable, adapter)
    with tempfile.TemporaryDirectory() as tmp:
        home = ProfileStore(tmp).save(
            PairingProfile(
                drafter=drafter.name,
                target=target.name,
                user="size",
                fingerprint="size",
                tensors={"adapter": tensors},
            )
        )
        disk = sum(f.stat().st_size for f in Path(home).rglob("*") if f.is_file())
    return {
        "disk_bytes": disk,
        "adapter_ram_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def cache_ablation(
    drafter: Any,
    target: Any,
    traces: list[TargetTrace],
    prompts: list[str],
    *,
    k: int,
    stop_confidence: float,
    full_cache: NgramCache | None = None,
) -> list[dict]:
    """The n-gram cache's gain under the paper's "ngram" translation, by size and policy.

    Gain = τ with the cache minus τ with none (max_entries=0). "full" is the default bound, which
    these prompts never fill (run with `full_cache` if given: benchmarks/ngram_cache.py's UseLog); "quarter"
    holds 1/4 of the entries the full run ended with.
    """
    replay = ReplayTarget.like(target, traces)
    run = lambda cache=None, **c: evaluate(
        drafter,
        replay,
        traces,
        prompts,
        k=k,  # noqa: E731
        stop_confidence=stop_confidence,
        strategy="ngram",
        ngram=NgramCacheConfig(**c),
        cache=cache,
    )
    none, full = run(max_entries=0), run(full_cache)
    quarter = max(1, full["ngram_entries"] // 4)
    rows = [{"cache": "none", **none}, {"cache": "full", **full}]  # (the full cache never evicts: no policy)
    for policy in ("lfu", "lfu-da", "lru"):
        rows.append(
            {
                "cache": f"quarter ({quarter} entries)",
                "policy": policy,
                **run(max_entries=quarter, policy=policy),
            }
        )
    for row in rows:
        row["gain_kept"] = gain_kept(row["tau"], none["tau"], full["tau"])
    return rows


def gain_kept(tau: float, none: float, full: float) -> float | None:
    """Share of the full cache's τ gain a smaller cache keeps; None when the full cache gains less
    than NO_GAIN (a ratio of two noise-sized numbers means nothing)."""
    return None if full - none < NO_GAIN else (tau - none) / (full - none)
