"""Building shortlists: token frequencies, clusters of the head's rows, the DynaSpec router.

Everything is fitted on the repository's training text only (GSM8K train questions and worked
answers, HumanEval problems 64-163 with their solutions, the second half of the CNN/DailyMail
sample), never on the prompts benchmarks evaluate, and cached per drafter tokenizer under
`$OMNIDRAFT_CACHE/shortlists/` (atomic; a corrupt file is rebuilt).
"""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_write_bytes

__all__ = ["POLICIES", "cluster_rows", "corpus", "frequent_ids", "shortlist", "train_router"]

log = logging.getLogger(__name__)

POLICIES = ("full", "static", "evo", "dyna")


def corpus() -> list[str]:
    """The training text (see module doc)."""
    from ..bench.datasets import data_dir, load_references

    texts = [p + a for p, a in load_references("gsm8k:train", 400)]
    texts += [p + a for p, a in load_references("humaneval:train", 100)]
    with open(data_dir() / "cnndm" / "train_sample.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    texts += [r["article"] for r in rows[len(rows) // 2 :]]
    return texts


def frequent_ids(tokenizer: Any, token_bytes: Any, texts: list[str], size: int, keep: set[int]) -> torch.Tensor:
    """The `size` most frequent ids of `texts` in this tokenizer that spell bytes (tokens a target
    can be given), most frequent first, then `keep` (the drafter's stop ids)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    usable = [t for t, _ in counts.most_common() if token_bytes.table[t]][:size]
    return torch.tensor(usable + sorted(keep - set(usable)), dtype=torch.long)


def cluster_rows(weight: torch.Tensor, m: int, *, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Spherical k-means of the head's rows (V, d) into `m` clusters: (V,) cluster of each row."""
    rows = nn.functional.normalize(weight.float(), dim=-1)
    g = torch.Generator().manual_seed(seed)
    centres = rows[torch.randperm(len(rows), generator=g)[:m]].clone()
    for _ in range(iters):
        assign = torch.cat([(chunk @ centres.T).argmax(-1) for chunk in rows.split(65536)])
        sums = torch.zeros_like(centres).index_add_(0, assign, rows)
        empty = torch.bincount(assign, minlength=m) == 0
        sums[empty] = rows[torch.randperm(len(rows), generator=g)[: int(empty.sum())]]
        centres = nn.functional.normalize(sums, dim=-1)
    return torch.cat([(chunk @ centres.T).argmax(-1) for chunk in rows.split(65536)])


@torch.no_grad()
def _hidden_and_next(model: Any, tokenizer: Any, texts: list[str], limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:256]
        if len(ids) < 2:
            continue
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        xs.append(out.hidden_states[-1][0, :-1].float())
        ys.append(torch.tensor(ids[1:]))
        if sum(len(y) for y in ys) >= limit:
            break
    return torch.cat(xs), torch.cat(ys)


def train_router(model: Any, tokenizer: Any, texts: list[str], assign: torch.Tensor, m: int, *, steps: int = 300,
                 tokens: int = 8000,
                 seed: int = 0) -> nn.Linear:
    """A linear router from the head's input (the last hidden state) to the cluster of the next
    token, trained by cross-entropy on `texts` (the next token of text stands in for the target's)."""
    x, y = _hidden_and_next(model, tokenizer, texts, tokens)
    labels = assign[y]
    torch.manual_seed(seed)
    router = nn.Linear(x.shape[1], m)
    opt = torch.optim.Adam(router.parameters(), lr=3e-3)
    for _ in range(steps):
        with torch.enable_grad():
            loss = nn.functional.cross_entropy(router(x), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    router.requires_grad_(False)
    return router


def _cache_path(name: str, fingerprint: str, kind: str, size: int, m: int) -> Any:
    from ..presets import cache_dir

    return cache_dir() / "shortlists" / f"{name}-{fingerprint[:16]}-{kind}-{size}-{m}.pt"


def shortlist(drafter: Any, kind: str, *, size: int = 8192, clusters: int = 64, capacity: int = 2048,
              budget: tuple[int, ...] = (8, 6, 4)) -> Any:
    """The policy object of `kind` ("static", "evo", "dyna") for `drafter`'s head, built once per
    drafter tokenizer and cached (the router is fitted through the drafter's fp32 weights)."""
    from .policies import Dyna, Evo, Static

    if kind not in POLICIES[1:]:
        raise ValueError(f"shortlist must be one of {POLICIES}, got {kind!r}")
    head = drafter.model.get_output_embeddings()
    head = getattr(head, "full", head)
    path = _cache_path(drafter.name, drafter.token_bytes.fingerprint, "dyna" if kind == "dyna" else "core", size, clusters)
    saved = None
    try:
        saved = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        pass
    if saved is None:
        texts = corpus()
        saved = {"core": frequent_ids(drafter.tokenizer, drafter.token_bytes, texts, size, set(drafter.stop_ids))}
        if kind == "dyna":
            fp32 = drafter.fp32_model()
            weight = fp32.get_output_embeddings().weight.detach()
            saved["assign"] = cluster_rows(weight, clusters)
            saved["router"] = train_router(fp32, drafter.tokenizer, texts, saved["assign"], clusters).state_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        atomic_write_bytes(path, buffer.getvalue())
        log.info("built the %s shortlist of %s (%d core tokens) into %s", kind, drafter.name, len(saved["core"]), path)
    stops = torch.tensor(sorted(drafter.stop_ids), dtype=torch.long)
    if kind == "static":
        return Static(head, saved["core"])
    if kind == "evo":
        return Evo(head, saved["core"], capacity)
    assign = saved["assign"]
    groups = [torch.nonzero(assign == c).flatten() for c in range(clusters)]
    router = nn.Linear(saved["router"]["weight"].shape[1], clusters)
    router.load_state_dict(saved["router"])
    router.requires_grad_(False)
    return Dyna(head, torch.cat([saved["core"][: max(1, size // 8)], stops]), groups, router, budget)
