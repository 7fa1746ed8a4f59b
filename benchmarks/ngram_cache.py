"""`python -m benchmarks ngram-cache`: what the n-gram cache buys, by size and eviction policy, on a pair of
tokenizers alone (no weights).

The cache pays only where the direct map proposes a split the target would not make: a word that is
one target token but two drafter tokens, each of which has a target copy (" Nat" + "alia" against
" Natalia"). Greedy verification rejects " Nat"; a cached merge proposes " Natalia" instead (the
paper's "ngram" translation, OmniDraft §3.1). With SmolLM2's 49k byte-level BPE against Qwen2.5
or Gemma 3, the pairs with weights here, that almost never happens (0.01 cache hits a round, see
README). The paper's own pair, a Llama-2 drafter (32k SentencePiece) against a Llama-3 target
(128k byte-level BPE), ships here as vocabularies only (shared/tokenizers), so this benchmark
replaces both models with text:
- the target's greedy output is the dataset's reference answer, spelled in target tokens
  (a `ReplayTarget` over those traces);
- `ReferenceDrafter` drafts the same text in its own tokens and gets each drafted token right with
  probability `accuracy` (drawn once per byte of each answer from a seed); a wrong token ends its draft.
The engine (session, translator, cache, resync) runs unchanged. What is measured is the translator
and its cache; the acceptance figures are those of a drafter of the stated accuracy, not of a model.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from itertools import accumulate
from typing import Any

import torch

from omnidraft.bench.datasets import load_references
from omnidraft.distill.trace_store import TargetTrace
from omnidraft.draft.picking import Draft
from omnidraft.translate.codec import ByteCodec
from omnidraft.translate.ngram_cache import NgramCache
from omnidraft.translate.token_bytes import TokenBytes, build_token_bytes

from .adapt import cache_ablation

__all__ = [
    "VOCABULARIES",
    "ReferenceDrafter",
    "TextEnd",
    "UseLog",
    "load_end",
    "markdown",
    "offline_optimum",
    "reference_traces",
    "run_cache_bench",
]

VOCABULARIES = {
    "llama-2": "ggml-vocab-llama-spm.gguf",
    "llama-3": "ggml-vocab-llama-bpe.gguf",
}  # in data/tokenizers

_BYTES_PER_TOKEN = 16  # encode this many bytes per drafted token: k tokens never run past the window


class TextEnd:
    """A tokenizer's side of the benchmark: tokenizer, byte view, codec and EOS ids, no model.
    Serves as the `target` of a ReplayTarget and as the byte view of a ReferenceDrafter."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.token_bytes: TokenBytes = build_token_bytes(tokenizer)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        self.eos_ids = frozenset({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def load_end(spec: str) -> TextEnd:
    """A tokenizer by the name of a shared vocabulary ("llama-2", "llama-3"), a preset, a .gguf
    path or an HF directory (models.load_tokenizer)."""
    from omnidraft.bench.datasets import data_dir
    from omnidraft.store.models import load_tokenizer

    path = data_dir() / "tokenizers" / VOCABULARIES[spec] if spec in VOCABULARIES else None
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"the {spec} vocabulary is not at {path}")
    return TextEnd(load_tokenizer(str(path) if path else spec), spec)


class ReferenceDrafter:
    """A drafter without weights (the `Drafter` protocol of drafter.py): for each prompt it knows
    the reference continuation, and drafts its next tokens as its own tokenizer spells the text
    from the committed byte on. A drafted token is wrong where the uniform draw of the byte it
    starts at is >= `accuracy` (one draw per byte of each reference, from `generator`, made once:
    every run over the same references errs at the same places, so the cache ablation's rows are
    paired). A wrong token is a single byte that differs from the right token's first, and ends
    the draft."""

    def __init__(
        self,
        end: TextEnd,
        references: dict[str, str],
        *,
        accuracy: float,
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0.0 < accuracy <= 1.0:
            raise ValueError(f"drafter accuracy must be in (0, 1], got {accuracy}")
        self.tokenizer, self.token_bytes, self.codec = end.tokenizer, end.token_bytes, end.codec
        self.name, self.stop_ids, self.accuracy = f"reference@{accuracy:g}:{end.name}", end.eos_ids, accuracy
        self._text: dict[tuple[int, ...], tuple[bytes, torch.Tensor]] = {}
        for prompt, reference in references.items():
            data = reference.encode()
            self._text[tuple(end.tokenizer(prompt)["input_ids"])] = (
                data,
                torch.rand(len(data) + 1, generator=generator) < accuracy,
            )

    def begin(self, ids: list[int]) -> _ReferenceSession:
        entry = self._text.get(tuple(ids))
        if entry is None:
            raise KeyError(f"no reference continuation for this prompt ({len(ids)} drafter tokens)")
        return _ReferenceSession(self, *entry)

    def wrong(self, right: int) -> int:
        """A single-byte token whose byte is not the first of `right`'s: the target rejects it."""
        first = (self.token_bytes.table[right] or b"\0")[:1]
        return self.token_bytes.byte_token[ord("|" if first == b"~" else "~")]


class _ReferenceSession:
    def __init__(self, owner: ReferenceDrafter, text: bytes, right: torch.Tensor) -> None:
        self.owner, self.text, self.right, self.pos, self.draft = owner, text, right, 0, []

    def propose(
        self,
        k: int,
        *,
        temperature: float = 0.0,
        allowed: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        stop_confidence: float = 0.0,
        stopper: Any = None,
        heal: torch.Tensor | None = None,
    ) -> Draft:
        o = self.owner
        ids = o.codec.encode(self.text[self.pos : self.pos + _BYTES_PER_TOKEN * (k + 1)])[:k]
        starts = accumulate(
            (len(o.token_bytes.table[t] or b"") for t in ids[:-1]), initial=self.pos
        )  # byte of each token
        miss = next((j for j, s in enumerate(starts) if not self.right[s]), len(ids))
        if miss < len(ids) or not ids:
            ids = ids[:miss] + [o.wrong(ids[miss] if ids else o.token_bytes.byte_token[ord(" ")])]
        self.draft = ids
        return Draft(ids)

    def commit(self, keep: int, tail: list[int]) -> None:
        self.pos += len(self.owner.token_bytes.join(self.draft[:keep] + tail))


def reference_traces(target: TextEnd, pairs: list[tuple[str, str]]) -> list[Any]:
    """Each reference continuation as the target's recorded greedy trace (no top-k rows)."""
    traces = []
    for prompt, reference in pairs:
        ids = target.codec.encode(reference.encode())
        traces.append(
            TargetTrace(
                target.tokenizer(prompt)["input_ids"],
                ids,
                torch.zeros(len(ids), 0, dtype=torch.long),
                torch.zeros(len(ids), 0),
            )
        )
    return traces


def run_cache_bench(
    drafter: TextEnd, target: TextEnd, *, dataset: str, n: int, k: int, accuracy: float, seed: int = 0
) -> dict[str, Any]:
    """The cache ablation of benchmarks/adapt.py (none, full, 1/4 LFU, LFU-DA and LRU) with the reference
    drafter on `n` prompts of `dataset`: every row replays the same prompts in the same order, and
    the drafter errs at the same places in each (drawn once from `seed`)."""
    target.token_bytes.require_byte_coverage(target.name)
    pairs = load_references(dataset, n)
    traces = reference_traces(target, pairs)
    prompts = [p for p, _ in pairs]
    oracle = ReferenceDrafter(
        drafter, dict(pairs), accuracy=accuracy, generator=torch.Generator().manual_seed(seed)
    )
    log = UseLog()
    rows = cache_ablation(oracle, target, traces, prompts, k=k, stop_confidence=0.0, full_cache=log)
    uses = rows[1]["ngram_hits_per_round"] * rows[1]["rounds"]  # the full cache's
    for row in rows:
        row["uses_kept"] = row["ngram_hits_per_round"] * row["rounds"] / uses if uses else None
    quarter = rows[-1]["ngram_entries"]
    used = {t for trace in traces for t in trace.continuation}
    spelled = {t: len(drafter.codec.encode(target.token_bytes.table[t] or b"")) for t in used}
    merged = sum(
        1 for trace in traces for t in trace.continuation if spelled[t] >= 2
    )  # need >= 2 drafter tokens
    return {
        "drafter": drafter.name,
        "target": target.name,
        "dataset": dataset,
        "n": len(traces),
        "k": k,
        "accuracy": accuracy,
        "seed": seed,
        "target_tokens": sum(len(t.continuation) for t in traces),
        "multi_token_words": merged,
        "rows": rows,
        "offline_optimum": {
            "entries": quarter,
            "uses_kept": offline_optimum(log.events, quarter),
            "added": len({key for _, key in log.events}),
            "ever_used": len({key for used, key in log.events if used}),
        },
    }


class UseLog(NgramCache):
    """An unbounded n-gram cache that logs every add and use, in order: the input of `offline_optimum`."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[bool, tuple[int, ...]]] = []  # (a use?, key)

    def add(self, key: tuple[int, ...], target_id: int) -> None:
        if self.admits(key):
            self.events.append((False, key))
        super().add(key, target_id)

    def use(self, key: tuple[int, ...]) -> int:
        self.events.append((True, key))
        return super().use(key)


def offline_optimum(events: list[tuple[bool, tuple[int, ...]]], capacity: int) -> float | None:
    """Share of the uses in `events` (a full cache's adds and uses) that a cache of `capacity`
    entries would still serve if it knew the future: Belady's MIN, which evicts the entry next used
    furthest ahead (possibly the one just added). No online policy keeps more of this sequence. (A
    smaller cache changes what is drafted next, so the sequence is the full cache's: an estimate.)"""
    upcoming: dict[tuple[int, ...], deque[int]] = defaultdict(deque)
    for i, (used, key) in enumerate(events):
        if used:
            upcoming[key].append(i)
    held: dict[tuple[int, ...], float] = {}  # key -> when it is next used
    heap: list[tuple[float, int, tuple[int, ...]]] = []  # (-next use, event, key), stale rows skipped
    hits = total = 0
    for i, (used, key) in enumerate(events):
        queue = upcoming[key]
        while queue and queue[0] <= i:
            queue.popleft()
        if used:
            total += 1
            hits += key in held
        if key in held or not used:
            held[key] = queue[0] if queue else math.inf
            heapq.heappush(heap, (-held[key], i, key))
        while len(held) > capacity:
            when, _, victim = heapq.heappop(heap)
            if held.get(victim) == -when:
                del held[victim]
    return hits / total if total else None


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# n-gram cache: {result['drafter']} drafting for {result['target']}, {result['dataset']} "
        f"({result['n']} reference answers, {result['target_tokens']} target tokens), k={result['k']}\n",
        f"Reference drafter, each token right with probability {result['accuracy']:g} (seed "
        f"{result['seed']}); "
        f'"ngram" translation. {result["multi_token_words"] / result["target_tokens"]:.1%} of the target\'s '
        "tokens take two or more drafter tokens to spell.\n",
        "| cache | policy | acceptance | τ | n-gram hits/round | entries | cache KB | share of the full "
        "cache's τ gain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        kept = row.get("gain_kept")
        lines.append(
            f"| {row['cache']} | {row.get('policy', '–')} | {row['acceptance_rate']:.3f} | {row['tau']:.3f} "
            "| "
            f"{row['ngram_hits_per_round']:.3f} | {row['ngram_entries']} | {row['ngram_bytes'] / 1024:.0f} | "
            f"{'–' if kept is None else f'{kept:.1%}'} |"
        )
    best = result.get("offline_optimum", {}).get("uses_kept")
    if best is not None:
        online = ", ".join(f"{r['policy']} {r['uses_kept']:.1%}" for r in result["rows"] if r.get("policy"))
        lines += [
            "",
            f"Share of the full cache's n-gram uses a {result['offline_optimum']['entries']}-entry cache "
            "serves: "
            f"{online}; knowing the future (Belady's MIN on the full run's adds and uses), {best:.1%}. "
            f"Of the {result['offline_optimum']['added']} merges the full run added, "
            f"{result['offline_optimum']['ever_used']} were ever used.",
        ]
    return "\n".join(lines) + "\n"
