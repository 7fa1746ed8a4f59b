"""Per-round records of a speculative generation, the statistics made from them, and JSONL traces.

One vocabulary everywhere: acceptance rate is accepted / proposed target
tokens averaged over rounds; tau is committed tokens per target forward (bonus included).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .contract import Round

__all__ = ["GenerationStats", "RoundRecord", "read_trace", "round_record", "write_trace"]

TRACE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One draft-translate-verify-resync round. Times in seconds; counts in target tokens except
    `drafted` (drafter tokens) and `context` (committed target tokens before the round).
    `retrieved` of the proposed tokens were retrieved (retrieve/) rather than drafted by the model,
    and `retrieved_accepted` of those were accepted."""

    context: int
    drafted: int
    proposed: int
    accepted: int
    emitted: int
    from_cache: int
    t_draft: float
    t_translate: float
    t_verify: float
    t_resync: float
    retrieved: int = 0
    retrieved_accepted: int = 0

    @property
    def seconds(self) -> float:
        return self.t_draft + self.t_translate + self.t_verify + self.t_resync


def round_record(
    rnd: Round | None, context: int, new: list[int], accepted: int, t_verify: float, t_resync: float = 0.0
) -> RoundRecord:
    """The record of a round that proposed `rnd` (None: a step that proposed nothing, the target
    decoding alone) at `context` committed tokens, and committed `new`."""
    if rnd is None:
        return RoundRecord(
            context=context,
            drafted=0,
            proposed=0,
            accepted=0,
            emitted=len(new),
            from_cache=0,
            t_draft=0.0,
            t_translate=0.0,
            t_verify=t_verify,
            t_resync=0.0,
        )
    proposal = rnd.proposal
    return RoundRecord(
        context=context,
        drafted=len(rnd.draft.ids),
        proposed=len(proposal),
        accepted=accepted,
        emitted=len(new),
        from_cache=rnd.cached_among(accepted),
        t_draft=rnd.drafted - rnd.started,
        t_translate=rnd.ready - rnd.drafted,
        t_verify=t_verify,
        t_resync=t_resync,
        retrieved=proposal.retrieved,
        retrieved_accepted=rnd.retrieved_among(accepted),
    )


_FIELDS = {f.name for f in fields(RoundRecord)}
_REQUIRED = {f.name for f in fields(RoundRecord) if f.name not in ("retrieved", "retrieved_accepted")}


@dataclass(frozen=True, kw_only=True)
class GenerationStats:
    """What a request did. `acceptance_rate`: accepted / proposed target tokens, averaged over
    rounds; `tau` (`mean_accepted_length`): committed tokens per target forward, bonus included;
    `served`: "speculate" (drafts verified round by round), "engine" (verified in the target
    engine's own step) or "alone" (the target decoded it without drafts), and `why`; with
    learning on, `adapter_steps` (the adapter's optimizer steps so far) and `adapter_note` (when
    the next update comes). `str()` reads as one line."""

    rounds: int
    new_tokens: int
    seconds: float
    acceptance_rate: float
    mean_accepted_length: float
    ngram_hits_per_round: float
    time_split: dict[str, float]
    speculating: float = 1.0  # share of rounds that drafted (a cost-driven pairing may decode alone)
    retrieved_share: float = 0.0  # share of the new tokens that were retrieved drafts, accepted
    acceptance_by_source: dict[str, float] | None = (
        None  # accepted / proposed, model and retrieved tokens apart
    )
    served: str = "speculate"
    why: str = ""
    adapter_steps: int | None = None
    adapter_note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Committed tokens per target forward, bonus included (`mean_accepted_length`)."""
        return self.mean_accepted_length

    def __str__(self) -> str:
        head = f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s)"
        if self.served == "alone":
            how = "decoded by the target alone"
        else:
            where = " in the engine's step" if self.served == "engine" else ""
            how = (
                f"drafts verified{where}: acceptance {self.acceptance_rate:.0%}, "
                f"tau {self.tau:.2f} tokens per target forward over {self.rounds} rounds"
            )
        parts = [head, how + (f" ({self.why})" if self.why else "")]
        if self.adapter_steps is not None:
            parts.append(
                f"adapter {self.adapter_steps} steps"
                + (f" ({self.adapter_note})" if self.adapter_note else "")
            )
        return "; ".join(parts)

    @classmethod
    def from_rounds(cls, rounds: list[RoundRecord], new_tokens: int, seconds: float) -> GenerationStats:
        proposing = [r.accepted / r.proposed for r in rounds if r.proposed > 0]
        total = sum(r.seconds for r in rounds) or 1.0
        split = {
            name: sum(getattr(r, f"t_{name}") for r in rounds) / total
            for name in ("draft", "translate", "verify", "resync")
        }
        return cls(
            rounds=len(rounds),
            new_tokens=new_tokens,
            seconds=seconds,
            acceptance_rate=fmean(proposing) if proposing else 0.0,
            mean_accepted_length=new_tokens / len(rounds) if rounds else 0.0,
            ngram_hits_per_round=fmean(r.from_cache for r in rounds) if rounds else 0.0,
            time_split=split,
            speculating=sum(r.drafted > 0 or r.retrieved > 0 for r in rounds) / len(rounds)
            if rounds
            else 1.0,
            retrieved_share=sum(r.retrieved_accepted for r in rounds) / new_tokens if new_tokens else 0.0,
            acceptance_by_source=_by_source(rounds),
        )


def _by_source(rounds: list[RoundRecord]) -> dict[str, float]:
    """Accepted / proposed target tokens of each source, over the whole generation. A model token
    counts as proposed when the round's model part was verified at all."""
    model_p = sum(r.proposed - r.retrieved for r in rounds)
    model_a = sum(r.accepted - r.retrieved_accepted for r in rounds)
    retr_p = sum(r.retrieved for r in rounds)
    retr_a = sum(r.retrieved_accepted for r in rounds)
    return {name: a / p for name, a, p in (("model", model_a, model_p), ("retrieved", retr_a, retr_p)) if p}


def write_trace(
    path: str | os.PathLike[str], rounds: Iterable[RoundRecord], meta: dict | None = None
) -> None:
    """Append one JSONL trace: a header line, then one line per round."""
    with Path(path).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"trace": "omnidraft", "version": TRACE_VERSION, **(meta or {})}) + "\n")
        for r in rounds:
            fh.write(json.dumps(asdict(r)) + "\n")


def read_trace(
    path: str | os.PathLike[str], *, select: dict[str, str] | None = None
) -> list[list[RoundRecord]]:
    """The generations of a JSONL trace, each a list of rounds (a header line starts each one).

    `select` keeps the generations whose header has those values (compared as text), e.g.
    {"dataset": "gsm8k", "rtt_ms": "50.0"}. A malformed, truncated or out-of-range line raises
    ValueError naming the file and line number. Imports nothing heavy: device_sim reads traces
    through this function.
    """
    runs: list[list[RoundRecord]] = []
    current: list[RoundRecord] | None = None  # the generation being read (None before any header)
    with Path(path).open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                doc = json.loads(line)
                if not isinstance(doc, dict):
                    raise ValueError("not a JSON object")
                if doc.get("trace") == "omnidraft":
                    current = []
                    if all(str(doc.get(k)) == v for k, v in (select or {}).items()):
                        runs.append(current)
                    continue
                if current is None:
                    raise ValueError("round before any trace header")
                if not _REQUIRED <= set(doc) <= _FIELDS:
                    raise ValueError(f"fields differ from a round record: {sorted(set(doc) ^ _FIELDS)}")
                r = RoundRecord(**doc)
                if (
                    min(
                        r.context,
                        r.drafted,
                        r.proposed,
                        r.accepted,
                        r.emitted,
                        r.retrieved,
                        r.retrieved_accepted,
                    )
                    < 0
                    or r.accepted > r.proposed
                    or r.retrieved > r.proposed
                    or r.retrieved_accepted > r.retrieved
                ):
                    raise ValueError("counts out of range")
                current.append(r)
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: malformed trace line: {exc}") from exc
    if not any(runs):
        raise ValueError(f"{path}: no rounds in trace" + (f" matching {select}" if select else ""))
    return [run for run in runs if run]
