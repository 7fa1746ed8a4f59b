"""Building shortlists: token frequencies, clusters of the head's rows, the DynaSpec router.

DynaSpec's core is the most frequent quarter of the static size; the head's other rows are
clustered by direction (spherical k-means) and the router scores a cluster by the hidden state's
dot product with its centroid: the clusters whose mean direction is nearest the hidden state hold
the rows with the largest logits (docs/shortlists.md has what that keeps against a trained router).

Token frequencies are counted on training text shipped with the package (GSM8K train questions
and worked answers, HumanEval problems 64-163 with their solutions, the second half of the
CNN/DailyMail sample), never on the prompts benchmarks evaluate, and cached per drafter tokenizer under
`$OMNIDRAFT_CACHE/shortlists/` or at a path the caller keeps beside the drafter. A file is
written atomically and carries its format version and the drafter tokenizer's fingerprint; one
that does not fit the drafter (version, tokenizer, vocabulary, clusters, router width) is
rebuilt in the cache and refused, naming why, at a caller's path.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..store.atomic import atomic_write_bytes
from .shortlisted_head import dense_weight

__all__ = ["FORMAT", "POLICIES", "check_fits", "cluster_rows", "corpus", "frequent_ids", "shortlist"]

log = logging.getLogger(__name__)

POLICIES = ("full", "static", "evo", "dyna")
CORPUS = Path(__file__).with_name("corpus.jsonl.gz")


def corpus() -> list[str]:
    """The training text (see module doc), shipped in the package (tools/shortlist_corpus.py
    writes it from the checkout's data/)."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def frequent_ids(
    tokenizer: Any, token_bytes: Any, texts: list[str], size: int, keep: set[int]
) -> torch.Tensor:
    """The `size` most frequent ids of `texts` in this tokenizer that spell bytes (tokens a target
    can be given), most frequent first, then `keep` (the drafter's stop ids)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    usable = [t for t, _ in counts.most_common() if token_bytes.table[t]][:size]
    return torch.tensor(usable + sorted(keep - set(usable)), dtype=torch.long)


def cluster_rows(
    weight: torch.Tensor, m: int, *, iters: int = 12, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means of the head's rows (V, d) into `m` clusters: ((V,) cluster of each row,
    (m, d) unit centroids)."""
    if not 1 <= m <= len(weight):
        raise ValueError(f"cannot cut {len(weight)} head rows into {m} clusters")
    rows = nn.functional.normalize(weight.float(), dim=-1)
    g = torch.Generator().manual_seed(seed)
    centres = rows[torch.randperm(len(rows), generator=g)[:m]].clone()
    for _ in range(iters):
        assign = torch.cat([(chunk @ centres.T).argmax(-1) for chunk in rows.split(65536)])
        sums = torch.zeros_like(centres).index_add_(0, assign, rows)
        empty = torch.bincount(assign, minlength=m) == 0
        sums[empty] = rows[torch.randperm(len(rows), generator=g)[: int(empty.sum())]]
        centres = nn.functional.normalize(sums, dim=-1)
    return torch.cat([(chunk @ centres.T).argmax(-1) for chunk in rows.split(65536)]), centres


# the version of a shortlist file's layout (4: clusters of the rows outside the core, routed by centroid)
FORMAT = 4


def _cache_path(name: str, fingerprint: str, kind: str, size: int, m: int) -> Any:
    from ..store.presets import cache_dir

    return cache_dir() / "shortlists" / f"{name}-{fingerprint[:16]}-{kind}-{size}-{m}.pt"


def check_fits(saved: Any, drafter: Any, kind: str, clusters: int, where: str) -> None:
    """Raise ValueError naming what in the shortlist file `saved` (read from `where`) does not fit
    `drafter`: its format version, tokenizer, vocabulary, ids, clusters or router width."""
    readable = {FORMAT} if kind == "dyna" else {2, 3, FORMAT}  # formats 3 and 4 changed only DynaSpec's part
    if not isinstance(saved, dict) or saved.get("format") not in readable:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: not a shortlist file of format {FORMAT} (found {got!r}); rebuild it")
    vocab = len(drafter.token_bytes.table)
    if saved.get("tokenizer") != drafter.token_bytes.fingerprint:
        raise ValueError(f"{where}: built for another tokenizer than {drafter.name}'s")
    core = saved.get("core")
    if (
        not isinstance(core, torch.Tensor)
        or core.dtype != torch.long
        or core.numel() == 0
        or int(core.max()) >= vocab
        or int(core.min()) < 0
    ):
        raise ValueError(f"{where}: its core ids do not fit {drafter.name}'s vocabulary of {vocab}")
    if kind != "dyna":
        return
    assign, router = saved.get("assign"), saved.get("router")
    if (
        not isinstance(assign, torch.Tensor)
        or assign.shape != (vocab,)
        or int(assign.max()) >= clusters
        or int(assign.min()) < -1
    ):
        raise ValueError(
            f"{where}: its clusters do not cover {drafter.name}'s {vocab} head rows in {clusters} clusters"
        )
    width = drafter.hidden_size
    if not isinstance(router, dict) or tuple(router.get("weight", torch.empty(0)).shape) != (clusters, width):
        raise ValueError(
            f"{where}: its router does not map {drafter.name}'s hidden size {width} to {clusters} clusters"
        )


def _dyna_core(core: torch.Tensor, size: int, stops: set[int]) -> torch.Tensor:
    """DynaSpec's core: the most frequent quarter of a static list of `size`, plus the stop ids."""
    return torch.cat([core[: max(1, size // 4)], torch.tensor(sorted(stops), dtype=torch.long)]).unique()


def _build(drafter: Any, head: nn.Module | None, kind: str, size: int, clusters: int) -> dict[str, Any]:
    saved: dict[str, Any] = {
        "format": FORMAT,
        "tokenizer": drafter.token_bytes.fingerprint,
        "core": frequent_ids(drafter.tokenizer, drafter.token_bytes, corpus(), size, set(drafter.stop_ids)),
    }
    if kind == "dyna":
        weight = dense_weight(head)
        outside = torch.ones(len(weight), dtype=torch.bool)
        outside[_dyna_core(saved["core"], size, set(drafter.stop_ids))] = False
        rows = torch.nonzero(outside).flatten()
        assign, centres = cluster_rows(weight[rows], clusters)
        saved["assign"] = torch.full((len(weight),), -1, dtype=torch.long).index_put_((rows,), assign)
        saved["router"] = {"weight": centres, "bias": torch.zeros(clusters)}
    return saved


def shortlist(
    drafter: Any,
    kind: str,
    *,
    size: int = 8192,
    clusters: int = 1024,
    capacity: int = 2048,
    budget: tuple[int, ...] = (8, 6, 4),
    path: str | os.PathLike[str] | None = None,
    head: nn.Module | None = None,
) -> Any:
    """The policy object of `kind` ("static", "evo", "dyna") for `drafter`'s head (or `head`, an
    LM head outside the drafter's model: an exported graph's; none for a graph that gathers its
    rows). Built once per drafter tokenizer and cached; a cached file that does not fit is
    rebuilt. `path`: a shortlist file kept beside the drafter instead: read when it exists
    (refused, naming why, when it does not fit), else built there. DynaSpec: `clusters` of the
    head's rows outside its core, `budget[j]` of them evaluated at draft position j."""
    from .supports import Dyna, Evo, Static

    if kind not in POLICIES[1:]:
        raise ValueError(f"shortlist must be one of {POLICIES}, got {kind!r}")
    if head is None and hasattr(drafter, "model"):
        head = drafter.model.get_output_embeddings()
    head = getattr(head, "full", head)  # None: blocks of ids only, for a graph that gathers its rows
    own = path is not None
    file = (
        Path(path)
        if path is not None
        else _cache_path(
            drafter.name,
            drafter.token_bytes.fingerprint,
            "dyna" if kind == "dyna" else "core",
            size,
            clusters,
        )
    )
    saved = _read(file, drafter, kind, clusters, own=own)
    if saved is None:
        if kind == "dyna" and head is None:
            raise ValueError(
                f"{drafter.name}: DynaSpec clusters the LM head's rows; this drafter has none outside its "
                "graph"
            )
        saved = _build(drafter, head, kind, size, clusters)
        _write(file, saved)
        log.info(
            "built the %s shortlist of %s (%d core tokens) into %s",
            kind,
            drafter.name,
            len(saved["core"]),
            file,
        )
    if kind == "static":
        return Static(head, saved["core"])
    if kind == "evo":
        return Evo(head, saved["core"], capacity)
    assign = saved["assign"]
    rows = torch.nonzero(assign >= 0).flatten()  # one sort, not a pass over the vocabulary per cluster
    groups = list(
        rows[assign[rows].argsort(stable=True)].split(
            torch.bincount(assign[rows], minlength=clusters).tolist()
        )
    )
    router = nn.Linear(saved["router"]["weight"].shape[1], clusters)
    router.load_state_dict(saved["router"])
    router.requires_grad_(False)
    return Dyna(head, _dyna_core(saved["core"], size, set(drafter.stop_ids)), groups, router, budget)


def _read(file: Path, drafter: Any, kind: str, clusters: int, *, own: bool) -> dict[str, Any] | None:
    """The shortlist kept in `file`, or None (none there, or a cached one that does not fit: rebuilt);
    a file of the user's own (`own`) that does not fit is refused, naming why."""
    if not file.exists():
        return None
    try:
        saved = torch.load(io.BytesIO(file.read_bytes()), weights_only=True)
        check_fits(saved, drafter, kind, clusters, str(file))
        return dict(saved)
    except Exception as exc:  # torch's unpickler raises many kinds on a torn file
        if own:
            raise ValueError(
                str(exc) if isinstance(exc, ValueError) else f"{file}: unreadable ({exc})"
            ) from None
        log.warning("rebuilding the %s shortlist of %s: %s", kind, drafter.name, exc)
        return None


def _write(file: Path, saved: dict[str, Any]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    atomic_write_bytes(file, buffer.getvalue())
