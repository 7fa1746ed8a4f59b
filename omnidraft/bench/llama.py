"""`omnidraft bench --target-backend llama.cpp`: the target on llama.cpp, every contender in one run.

Rows, on the same prompts and the same GGUF file, each greedy, timed per request (prefill included):
- llama.cpp alone: llama-cpp-python's own `generate` on a plain `Llama` (the speed to beat);
- llama.cpp speculative: its `generate` with a same-vocabulary GGUF draft model (the 0.5B drafting
  for the 1.5B), drafted as llama.cpp's own speculative example does (greedy, up to 16 tokens,
  stopped below 0.75 draft probability);
- llama.cpp prompt lookup: its `generate` with `LlamaPromptLookupDecoding` (its defaults);
- omnidraft, in process: the SmolLM2 drafter on each installed backend paired with
  `LlamaCppTarget` (defaults: hybrid drafts; what drafting can gain decided from the target's
  measured verify costs, then per round), and the llama.cpp drafter under the "compute" objective
  (no best-speedup check and no mode chooser: every request speculates, its cost policy still skips rounds),
  to show what drafting costs where the defaults decline it;
- omnidraft through the hook: llama-cpp-python's `generate` with `OmnidraftDraftModel`;
- the fp32 PyTorch target alone, for reference.
llama-cpp-python keeps logits for every position once a draft model is set (`logits_all`): the
rows that use its `draft_model` pay that, prompt included; the in-process rows do not.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .baselines import Timed

if TYPE_CHECKING:
    from ..llamacpp.llama_target import LlamaCppTarget
    from ..pairing import Pairing

__all__ = ["GgufDraft", "engine_generate", "llama_alone", "run_llama", "summarize_llama", "time_rows"]

SPEC_MAX, SPEC_P_MIN = 16, 0.75  # llama.cpp's speculative defaults (draft-max, draft-p-min)


def GgufDraft(engine: Any, n_max: int = SPEC_MAX, p_min: float = SPEC_P_MIN) -> Any:  # noqa: N802
    """A `LlamaDraftModel` drafting greedily with another GGUF model of the same vocabulary (a class
    factory, named like the class it returns)."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class _GgufDraft(LlamaDraftModel):
        def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
            ids, out = [int(t) for t in input_ids], list[int]()
            for _ in range(n_max):
                row = engine.logits(ids + out, 1)[0]
                token = int(row.argmax())
                p = 1.0 / float(np.exp(row - row[token]).sum())
                if p < p_min:
                    break
                out.append(token)
            return np.asarray(out, dtype=np.intc)

    return _GgufDraft()


def engine_generate(llm: Any, ids: list[int], n: int, eos: frozenset[int]) -> Timed:
    """llama-cpp-python's `generate`, greedy, on a fresh context: its default reuses the prefix the
    last request left, whose entries were computed in other batches, so its output would depend on
    the request before (and no row would be comparable with another)."""
    llm.reset()
    started, out = time.perf_counter(), []
    for token in llm.generate(ids, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) >= n or token in eos:
            break
    return Timed(out, time.perf_counter() - started)


N_CTX = 4096  # the context every llama.cpp row runs with


def llama_alone(target: LlamaCppTarget, n: int, n_ctx: int = N_CTX) -> Callable[..., Timed]:
    """The "llama.cpp alone" row, the speed to beat: llama-cpp-python's own `generate` on a plain
    `Llama` of the `LlamaCppTarget` `target`'s GGUF file, called with (prompt, ids), `n` tokens a
    request (or the third argument's)."""
    from ..llamacpp.loading import open_llama

    plain = open_llama(target.engine.path, n_ctx=n_ctx)
    return lambda prompt, ids, tokens=n: engine_generate(plain, ids, tokens, target.eos_ids)


def pairing_row(pair: Pairing, n: int, prompt: str, ids: list[int]) -> Timed:
    """A timed row of `pair` generating `n` tokens after `prompt` (`ids`: the same, tokenized)."""
    started = time.perf_counter()
    out = pair.generate(prompt, max_new_tokens=n)
    return Timed(out.token_ids, time.perf_counter() - started)


SAME_VOCAB_DRAFT = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # llama.cpp's own draft model, by target


def run_llama(
    drafter_spec: str,
    target_spec: str,
    prompts: list[str],
    max_new_tokens: int,
    *,
    peers: bool = True,
    repeats: int = 1,
    notes: list[str] | None = None,
    progress: Callable[[str], object] = lambda _: None,
) -> list[dict[str, Any]]:
    """Per prompt, per row: {"row", "prompt", "tokens", "seconds", "identical"} (identical: the
    same ids as llama.cpp alone; seconds: the median of `repeats` runs, see `time_rows`). `notes`
    receives each pairing's best speedup (why it drafts or not). The peers: llama.cpp's own
    speculative decoding with a draft model of the target's vocabulary (`SAME_VOCAB_DRAFT`), its
    prompt lookup, and the PyTorch fp32 target; without `peers`, only llama.cpp alone and
    omnidraft's rows."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    import omnidraft as od

    from ..llamacpp.engine import LlamaEngine
    from ..llamacpp.hook import OmnidraftDraftModel
    from ..llamacpp.loading import gguf_file, open_llama

    n_ctx = N_CTX
    target = od.LlamaCppTarget(target_spec, n_ctx=n_ctx)
    rows: dict[str, Callable[[str, list[int]], Timed]] = {
        "llama.cpp alone": llama_alone(target, max_new_tokens, n_ctx)
    }
    # what llama-cpp-python sets with a draft model
    spec = open_llama(target.engine.path, n_ctx=n_ctx, logits_all=True)
    drafters = {
        "llama.cpp": od.Drafter.load(drafter_spec, backend="llama.cpp"),
        "torch int8": od.Drafter.load(drafter_spec, backend="torch"),
    }
    drafts: dict[str, Any] = {}
    same_vocab_draft = SAME_VOCAB_DRAFT.get(target_spec)
    if same_vocab_draft and peers:
        drafts[f"llama.cpp speculative ({same_vocab_draft} draft)"] = GgufDraft(
            LlamaEngine(gguf_file(same_vocab_draft)[0], n_ctx=n_ctx)
        )
    if peers:
        drafts["llama.cpp prompt lookup"] = LlamaPromptLookupDecoding()
    drafts["omnidraft via draft_model"] = OmnidraftDraftModel(drafters["llama.cpp"], target)

    def with_draft(draft: Any) -> Callable[[str, list[int]], Timed]:
        def row(p: str, ids: list[int]) -> Timed:
            spec.draft_model = draft
            return engine_generate(spec, ids, max_new_tokens, target.eos_ids)

        return row

    for name, draft in drafts.items():
        rows[name] = with_draft(draft)
    pairs = {f"omnidraft ({backend} drafter)": drafter.pair(target) for backend, drafter in drafters.items()}
    pairs["omnidraft (llama.cpp drafter, compute objective)"] = drafters["llama.cpp"].pair(
        target, objective="compute"
    )
    for name, pair in pairs.items():
        rows[name] = partial(pairing_row, pair, max_new_tokens)
        s = pair.speculator
        if notes is not None and s.best_speedup is not None:
            notes.append(
                f"{name}: {'drafts' if s.drafting else 'decodes alone'} "
                f"(model drafts {'on' if s.model_drafts else 'off'}, retrieved drafts "
                f"{'on' if s.free_drafts else 'off'}): {s.best_speedup.reason()}"
            )
    if peers:
        from .baselines import target_alone

        local = od.LocalTarget.load(target_spec)
        rows["PyTorch fp32 target alone"] = lambda p, ids: target_alone(local, p, max_new_tokens)
    return time_rows(rows, prompts, target.tokenizer, progress, repeats=repeats)


def time_rows(
    rows: dict[str, Callable[[str, list[int]], Timed]],
    prompts: list[str],
    tokenizer: Any,
    progress: Callable[[str], object],
    references: list[list[int]] | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Every row on every prompt, the rows' round repeated `repeats` times (a request's seconds: the
    median of its runs, kept in `runs`, so that a burst of the host's noise does not decide a
    request's ratio). Each round starts one row later than the last (prompt by prompt, repeat by
    repeat), so no row always runs first or right after the same other row. The first row's output
    is the reference each other row's is compared with (a shorter output compares as far as it
    goes: it stopped; every run must agree), unless `references` gives each prompt's (then every row
    is compared with it, and the outputs of the first row are appended to a list passed as
    `references=[]`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results = []
    given = bool(references)
    names = list(rows)
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        runs: dict[str, list[Timed]] = {name: [] for name in rows}
        for r in range(repeats):
            turn = (i * repeats + r) % len(names)
            for name in names[turn:] + names[:turn]:
                progress(f"prompt {i + 1}/{len(prompts)}, run {r + 1}/{repeats}: {name}")
                runs[name].append(rows[name](prompt, ids))
        if given and references is not None:
            reference = references[i]
        else:
            reference = runs[names[0]][0].token_ids
            if references is not None:
                references.append(reference)
        for name, timed in runs.items():
            results.append(
                {
                    "row": name,
                    "prompt": i,
                    "tokens": len(timed[0].token_ids),
                    "seconds": float(np.median([t.seconds for t in timed])),
                    "runs": [t.seconds for t in timed],
                    "identical": all(t.token_ids == reference[: len(t.token_ids)] for t in timed),
                }
            )
    return results


def summarize_llama(results: list[dict[str, Any]], base: str = "llama.cpp alone") -> list[dict[str, Any]]:
    """Per row: tok/s over all prompts, speedup over the `base` row (total time), the worst
    request's speedup (its tok/s over the base row's on the same prompt: the per-request floor)
    and the identical count."""
    base_rows = [r for r in results if r["row"] == base]
    base_rate = sum(r["tokens"] for r in base_rows) / sum(r["seconds"] for r in base_rows)
    base_of = {r["prompt"]: r["tokens"] / r["seconds"] for r in base_rows if r["tokens"]}
    out = []
    for name in dict.fromkeys(r["row"] for r in results):
        mine = [r for r in results if r["row"] == name]
        rate = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
        each = [
            r["tokens"] / r["seconds"] / base_of[r["prompt"]]
            for r in mine
            if r["tokens"] and r["prompt"] in base_of
        ]
        out.append(
            {
                "row": name,
                "tok_s": rate,
                "speedup": rate / base_rate,
                "worst": min(each, default=float("nan")),
                "identical": sum(r["identical"] for r in mine),
                "prompts": len(mine),
            }
        )
    return out
