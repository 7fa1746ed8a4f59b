"""Building shortlists: token frequencies, clusters of the head's rows, the DynaSpec router.

Everything is fitted on the repository's training text only (GSM8K train questions and worked
answers, HumanEval problems 64-163 with their solutions, the second half of the CNN/DailyMail
sample), never on the prompts benchmarks evaluate, and cached per drafter tokenizer under
`$OMNIDRAFT_CACHE/shortlists/` or at a path the caller keeps beside the drafter. A file is
written atomically and carries its format version and the drafter tokenizer's fingerprint; one
that does not fit the drafter (version, tokenizer, vocabulary, clusters, router width) is
rebuilt in the cache and refused, naming why, at a caller's path.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_write_bytes

__all__ = ["FORMAT", "POLICIES", "check_fits", "cluster_rows", "corpus", "frequent_ids", "shortlist", "train_router"]

log = logging.getLogger(__name__)

POLICIES = ("full", "static", "evo", "dyna")
POSITIONS = 40000  # training-text positions a DynaSpec router is fitted on


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
    """The final hidden state (the LM head's input) at each position of `texts` and the next id,
    `limit` positions at most; the base model only (the head's logits are not needed)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    xs, ys = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:256]
        if len(ids) < 2:
            continue
        xs.append(base(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1].float())
        ys.append(torch.tensor(ids[1:]))
        if sum(len(y) for y in ys) >= limit:
            break
    return torch.cat(xs), torch.cat(ys)


def train_router(model: Any, tokenizer: Any, texts: list[str], assign: torch.Tensor, m: int, *, steps: int = 400,
                 tokens: int = POSITIONS, core: torch.Tensor | None = None, seed: int = 0,
                 head: nn.Module | None = None) -> nn.Linear:
    """A linear router from the head's input (the last hidden state) to the cluster of the drafter's
    own full-head argmax there, trained by cross-entropy over the positions of `texts`: a call that
    evaluates that cluster drafts what the full head drafts. With `core`, only on positions whose
    argmax is outside it: the core is always evaluated, so the router's clusters are worth only
    where the core falls short. `head`: the LM head the drafter drafts with (its int8 head: that
    argmax, and several times faster over a large vocabulary), default `model`'s own."""
    x, _ = _hidden_and_next(model, tokenizer, texts, tokens)
    head = head if head is not None else model.get_output_embeddings()
    with torch.no_grad():
        y = torch.cat([head(chunk).argmax(-1) for chunk in x.split(256)])
    if core is not None:
        outside = torch.ones(len(assign), dtype=torch.bool)
        outside[core] = False
        x, y = x[outside[y]], y[outside[y]]
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


FORMAT = 3  # the version of a shortlist file's layout (2: the router trained outside the core; 3: on the drafter's argmax)


def _cache_path(name: str, fingerprint: str, kind: str, size: int, m: int, positions: int) -> Any:
    from ..presets import cache_dir

    fitted = "" if positions == POSITIONS else f"-p{positions}"
    return cache_dir() / "shortlists" / f"{name}-{fingerprint[:16]}-{kind}-{size}-{m}{fitted}.pt"


def check_fits(saved: Any, drafter: Any, kind: str, clusters: int, where: str) -> None:
    """Raise ValueError naming what in the shortlist file `saved` (read from `where`) does not fit
    `drafter`: its format version, tokenizer, vocabulary, ids, clusters or router width."""
    readable = {FORMAT} if kind == "dyna" else {2, FORMAT}  # format 3 changed only how the router is fitted
    if not isinstance(saved, dict) or saved.get("format") not in readable:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: not a shortlist file of format {FORMAT} (found {got!r}); rebuild it")
    vocab = len(drafter.token_bytes.table)
    if saved.get("tokenizer") != drafter.token_bytes.fingerprint:
        raise ValueError(f"{where}: built for another tokenizer than {drafter.name}'s")
    core = saved.get("core")
    if not isinstance(core, torch.Tensor) or core.dtype != torch.long or core.numel() == 0 or int(core.max()) >= vocab \
            or int(core.min()) < 0:
        raise ValueError(f"{where}: its core ids do not fit {drafter.name}'s vocabulary of {vocab}")
    if kind != "dyna":
        return
    assign, router = saved.get("assign"), saved.get("router")
    if not isinstance(assign, torch.Tensor) or assign.shape != (vocab,) or int(assign.max()) >= clusters:
        raise ValueError(f"{where}: its clusters do not cover {drafter.name}'s {vocab} head rows in {clusters} clusters")
    width = drafter.hidden_size
    if not isinstance(router, dict) or tuple(router.get("weight", torch.empty(0)).shape) != (clusters, width):
        raise ValueError(f"{where}: its router does not map {drafter.name}'s hidden size {width} to {clusters} clusters")


def _build(drafter: Any, kind: str, size: int, clusters: int, positions: int) -> dict[str, Any]:
    texts = corpus()
    saved: dict[str, Any] = {"format": FORMAT, "tokenizer": drafter.token_bytes.fingerprint,
                             "core": frequent_ids(drafter.tokenizer, drafter.token_bytes, texts, size, set(drafter.stop_ids))}
    if kind == "dyna":
        fp32 = drafter.fp32_model()
        weight = fp32.get_output_embeddings().weight.detach()
        saved["assign"] = cluster_rows(weight, clusters)
        core = torch.cat([saved["core"][: max(1, size // 8)], torch.tensor(sorted(drafter.stop_ids), dtype=torch.long)])
        head = drafter.model.get_output_embeddings()
        saved["router"] = train_router(fp32, drafter.tokenizer, texts, saved["assign"], clusters, core=core,
                                       head=getattr(head, "full", head), tokens=positions).state_dict()
    return saved


def shortlist(drafter: Any, kind: str, *, size: int = 8192, clusters: int = 64, capacity: int = 2048,
              budget: tuple[int, ...] = (8, 6, 4), path: str | os.PathLike[str] | None = None,
              head: nn.Module | None = None, positions: int = POSITIONS) -> Any:
    """The policy object of `kind` ("static", "evo", "dyna") for `drafter`'s head (or `head`, an
    LM head outside the drafter's model: an exported graph's; none for a graph that gathers its rows). Built once per drafter tokenizer and
    cached (the router is fitted through the drafter's fp32 weights: only a PyTorch drafter builds
    one); a cached file that does not fit is rebuilt. `path`: a shortlist file kept beside the
    drafter instead: read when it exists (refused, naming why, when it does not fit), else built there.
    `positions`: how many positions of the training text a DynaSpec router is fitted on (its build
    time grows with them)."""
    from .policies import Dyna, Evo, Static

    if kind not in POLICIES[1:]:
        raise ValueError(f"shortlist must be one of {POLICIES}, got {kind!r}")
    if not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be an integer >= 1, got {positions!r}")
    if head is None and hasattr(drafter, "model"):
        head = drafter.model.get_output_embeddings()
    head = getattr(head, "full", head)  # None: blocks of ids only, for a graph that gathers its rows
    own = path is not None
    file = Path(path) if own else _cache_path(drafter.name, drafter.token_bytes.fingerprint,
                                               "dyna" if kind == "dyna" else "core", size, clusters,
                                               positions if kind == "dyna" else POSITIONS)
    saved = None
    if file.exists():
        try:
            saved = torch.load(io.BytesIO(file.read_bytes()), weights_only=True)
            check_fits(saved, drafter, kind, clusters, str(file))
        except Exception as exc:  # torch's unpickler raises many kinds on a torn file
            if own:
                raise ValueError(str(exc) if isinstance(exc, ValueError) else f"{file}: unreadable ({exc})") from None
            log.warning("rebuilding the %s shortlist of %s: %s", kind, drafter.name, exc)
            saved = None
    if saved is None:
        if kind == "dyna" and not hasattr(drafter, "fp32_model"):
            raise ValueError(f"{drafter.name}: a DynaSpec router is fitted through the PyTorch drafter's weights; build "
                             "it there (Drafter.load(spec).use_shortlist('dyna', path=FILE)) and pass path=FILE here")
        saved = _build(drafter, kind, size, clusters, positions)
        file.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        atomic_write_bytes(file, buffer.getvalue())
        log.info("built the %s shortlist of %s (%d core tokens) into %s", kind, drafter.name, len(saved["core"]), file)
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
