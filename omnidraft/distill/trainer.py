"""Online distillation of the drafter (OmniDraft Algorithm 2): examples in, optimizer steps out.

`OnlineTrainer` owns one optimizer over the parameters that require gradients (the active LoRA
adapter, or every weight for full fine-tuning) and the hybrid loss of losses.py:
    L = KL(direct tokens) + lambda * NLL(n-gram sub-tokens)
Every `interval` requests it runs `epochs` passes over its buffer in batches, then empties it.
Weights change only inside `step_lock`, which drafting also holds while it proposes: a draft never
reads half-updated weights, whichever thread trains. Losses never change what the target commits.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .buffer import Buffer, Example
from .losses import direct_kl, ngram_approx_kl, ngram_nll, position_weights

__all__ = ["OnlineTrainer", "Preempted", "TrainConfig"]


class Preempted(Exception):
    """A unit of learning stopped at a layer boundary because a request began (`stop`)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Algorithm 2's knobs. `interval`: requests between updates (I); `epochs`: passes over the
    buffer per update. `lam`: weight of the n-gram term, or "dynamic" for the target's p(t) per
    token; `kl`/`ngram_loss` switch terms for ablations ("nll", "approx_kl" or "none").
    `beta` > 0 adds EvoSpec's position weights exp(-beta * L * (j - 1)) with L = `draft_len`.
    `spans`: also label misaligned runs of target tokens (buffer.py), weighted like n-gram tokens;
    False gives the paper's labels. On by default: every SmolLM2 newline+indent token (e.g. "\n   ")
    lacks a counterpart in Qwen2.5's and Gemma 3's vocabularies, so without spans the reverse KL's remainder
    bucket only ever pushes them down and the drafter unlearns how to spell indentation (Gemma
    HumanEval, measured in docs/distillation.md).
    `direct_nll` adds that weight times the NLL of the committed token at direct positions
    (hard-label distillation: in greedy mode the committed token is the target's argmax, which is
    what greedy verification accepts; the reverse KL alone may settle on another mode of p, and its
    gradient fades as q nears p). 0 gives the paper's loss; 1 is what learning pairings use (it
    keeps more held-out acceptance gain: docs/distillation.md).
    `decay_steps` > 0 anneals the learning rate from `lr` to `lr * final_lr_ratio` along a cosine
    over that many optimizer steps, then holds it there (0: constant, Algorithm 2's); the steps a
    profile already had count (`OnlineTrainer(start_step=)`), so a reloaded profile resumes the schedule.
    `context` > 0 keeps only that many prompt tokens before each reply in an example (the rest
    costs forward and backward time and carries no loss; 0: the whole prompt).
    `topk`: target log-probabilities kept per position.
    `guard_every`: one request in this many is scored for the learner's guard (distill/learner.py:
    the adapter against its baseline, two forwards without gradient).
    `cpu_share` > 0 holds learning to that share of the CPU time the pairing's requests take: a
    request that would go over it is not learned from (0: every request is, whatever it costs).
    0.15 by default: on a device, learning is what the user did not ask for; the requests of a
    learning pairing also keep what it learns from, which this share does not count
    (docs/personalization.md, "What it costs the device").
    `background`: learn in a thread of the learner's own while no request runs
    (distill/learner.py): a reply never waits for its own request's learning, a request that comes
    while a unit of learning runs waits for that unit; False learns inline, before `generate`
    returns (reproducible: tests and benchmarks).
    `tts_every` > 0 turns on Test-Time Speculation: inside one request, every `tts_every` rounds a
    fast step (Adam, fresh for each request, `tts_lr`) on what that request has verified so far,
    undone at its end."""

    interval: int = 8
    batch_size: int = 8
    epochs: int = 1
    lr: float = 1e-4
    decay_steps: int = 0
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    lam: float | str = 0.2
    kl: bool = True
    ngram_loss: str = "nll"
    spans: bool = True
    direct_nll: float = 1.0
    beta: float = 0.0
    draft_len: int = 6
    topk: int = 32
    context: int = 0
    capacity: int = 256
    guard_every: int = 2
    cpu_share: float = 0.15
    background: bool = True
    seed: int = 0
    tts_every: int = 0
    tts_lr: float = 1e-3

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step that follows `step` earlier ones."""
        if not self.decay_steps:
            return self.lr
        done = min(step, self.decay_steps) / self.decay_steps
        return self.lr * (
            self.final_lr_ratio + (1 - self.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))
        )

    def __post_init__(self) -> None:
        if not isinstance(self.context, int) or self.context < 0:
            raise ValueError(
                f"TrainConfig.context must be an integer >= 0 (0: the whole prompt), got {self.context!r}"
            )
        if not isinstance(self.cpu_share, (int, float)) or not 0 <= self.cpu_share:
            raise ValueError(
                f"TrainConfig.cpu_share must be a number >= 0 (0: no cap), got {self.cpu_share!r}"
            )
        for name in ("interval", "batch_size", "epochs", "topk", "capacity", "draft_len", "guard_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.lr > 0 or self.weight_decay < 0 or self.beta < 0 or self.direct_nll < 0:
            raise ValueError(
                f"need lr > 0, weight_decay >= 0, beta >= 0, direct_nll >= 0; "
                f"got {self.lr}, {self.weight_decay}, {self.beta}, {self.direct_nll}"
            )
        if not isinstance(self.decay_steps, int) or self.decay_steps < 0 or not 0 <= self.final_lr_ratio <= 1:
            raise ValueError(
                f"need an integer decay_steps >= 0 (0: constant lr) and 0 <= final_lr_ratio <= 1; "
                f"got {self.decay_steps!r}, {self.final_lr_ratio!r}"
            )
        if not isinstance(self.tts_every, int) or self.tts_every < 0 or not self.tts_lr > 0:
            raise ValueError(
                f"need an integer tts_every >= 0 (0: off) and tts_lr > 0; got {self.tts_every!r}, "
                f"{self.tts_lr!r}"
            )
        if self.lam != "dynamic" and not (isinstance(self.lam, (int, float)) and self.lam >= 0):
            raise ValueError(f"lam must be a number >= 0 or 'dynamic', got {self.lam!r}")
        if self.ngram_loss not in ("nll", "approx_kl", "none"):
            raise ValueError(f"ngram_loss must be 'nll', 'approx_kl' or 'none', got {self.ngram_loss!r}")
        if not self.kl and self.ngram_loss == "none":
            raise ValueError("TrainConfig with kl=False and ngram_loss='none' has no loss to train on")


class OnlineTrainer:
    """Trains the parameters of `model` that require gradients; `t2d` (Vt,) maps target ids to
    drafter ids (-1 where none). `model` is a peft model or a plain HF causal LM. `start_step`: the
    optimizer steps the adapter had before this trainer (a reloaded profile's), for the lr schedule."""

    def __init__(
        self,
        model: Any,
        t2d: torch.Tensor,
        config: TrainConfig = TrainConfig(),
        step_lock: threading.RLock | None = None,
        start_step: int = 0,
    ) -> None:
        self.model, self.t2d, self.config = model, t2d, config
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(
                "this model has no parameters that require gradients: add an adapter or unfreeze it"
            )
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.buffer = Buffer(config.capacity)
        self.step_lock = step_lock or threading.RLock()
        self.steps, self.requests = 0, 0
        self.history: list[dict[str, Any]] = []  # one dict per optimizer step
        self.start_step = start_step
        self._rng = random.Random(config.seed)
        self._grads: list[torch.Tensor] | None = None  # the step being built (`accumulate`)
        self._parts: dict[str, float] = {}  # and its loss terms so far

    def add(self, example: Example) -> bool:
        """Buffer one request's example; True when `interval` requests have come since the last update."""
        self.buffer.add(example)
        self.requests += 1
        return self.requests % self.config.interval == 0

    def update(self) -> list[dict[str, float]]:
        """`epochs` passes over the buffer, one optimizer step per batch; then the buffer is emptied."""
        return [self.step(batch) for batch in self.take_batches()]

    def take_batches(self) -> list[list[Example]]:
        """An update's batches (`epochs` shuffled passes over the buffer), the buffer emptied."""
        size = self.config.batch_size
        batches = [b for _ in range(self.config.epochs) for b in self.buffer.batches(size, self._rng)]
        self.buffer.clear()
        return batches

    def step(self, batch: list[Example], optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
        """One optimizer step on `batch`: its examples' gradients accumulated one by one, then
        applied. With another `optimizer` (Test-Time Speculation's fast steps) the step is not
        counted in `steps` or `history`: those record the lasting updates."""
        pending, self._grads, self._parts = (self._grads, self._parts), None, {}
        try:  # (a step being built between requests is left as it was: Test-Time Speculation's
            for example in batch:  # fast steps come inside a request that stopped it)
                self.accumulate(example, batch)
            return self.apply(optimizer)
        finally:
            self._grads, self._parts = pending

    def accumulate(
        self, example: Example, batch: list[Example], stop: Callable[[], bool] | None = None
    ) -> None:
        """Add `example`'s share of `batch`'s loss gradient to the step being built (`apply` takes
        it): one forward and backward over one example, a unit of learning a request waits for at
        most one layer of (`stop`: checked at every layer, forward and backward; True raises
        `Preempted` and adds nothing)."""
        was_training = self.model.training
        self.model.train()
        try:
            with self._stoppable(stop):
                total, parts = self.loss(batch, part=[example])
                grads = torch.autograd.grad(total, self.params, allow_unused=True)
        finally:
            self.model.train(was_training)
        if self._grads is None:
            self._grads = [torch.zeros_like(p) for p in self.params]
        for acc, g in zip(self._grads, grads):
            if g is not None:
                acc += g
        for name, value in {"loss": float(total.detach()), **parts}.items():
            self._parts[name] = self._parts.get(name, 0.0) + value

    @property
    def accumulated(self) -> bool:
        """Whether a gradient is waiting for `apply`."""
        return self._grads is not None

    def apply(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
        """One optimizer step with the gradient accumulated since the last one (`accumulate`)."""
        opt = optimizer or self.optimizer
        grads, self._grads, parts, self._parts = self._grads, None, self._parts, {}
        if grads is None:
            raise RuntimeError("apply() with no gradient accumulated: accumulate() an example first")
        for p, g in zip(self.params, grads):
            p.grad = g
        if optimizer is None:
            for group in opt.param_groups:
                group["lr"] = self.config.lr_at(self.start_step + self.steps)
        with self.step_lock:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if optimizer is not None:
            return parts
        self.steps += 1
        log = {"step": self.steps, "lr": opt.param_groups[0]["lr"], **parts}
        self.history.append(log)
        return log

    def loss(
        self, batch: list[Example], part: list[Example] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The hybrid loss of one batch (each term a mean over the batch's labelled rows), and its
        terms as floats; with `part`, those examples' share of it (the parts' shares add up to the
        batch's loss: one forward over `part` only)."""
        cfg = self.config
        part = batch if part is None else part
        logits, kl_logits, ng_logits = self._logits(part)
        cat = lambda name: torch.cat([getattr(e, name) for e in part])  # noqa: E731
        mine = [self._weights(e) for e in part]
        whole = [self._weights(e) for e in batch] if part is not batch else mine
        totals = {name: sum(w[name].sum() for w in whole) for name in ("kl", "rows", "ng")}
        share = lambda name, w: w.sum() / totals[name]  # noqa: E731
        total, parts = logits.sum() * 0.0, {}
        weights = {name: torch.cat([w[name] for w in mine]) for name in ("kl", "ng")}
        if cfg.kl and len(kl_logits):
            w = weights["kl"]
            term = direct_kl(kl_logits, cat("kl_ids"), cat("kl_logp"), self.t2d, w) * share("kl", w)
            total, parts["kl"] = total + term, float(term.detach())
        if cfg.direct_nll > 0 and len(kl_logits):
            committed = torch.cat([e.ids[e.kl_rows + 1] for e in part])  # row r predicts ids[r + 1]
            w = torch.ones(len(committed))
            term = ngram_nll(kl_logits, committed) * share("rows", w)
            total, parts["direct_nll"] = total + cfg.direct_nll * term, float(term.detach())
        if cfg.ngram_loss != "none" and len(ng_logits):
            term = self._ngram_term(part, ng_logits, weights["ng"]) * share("ng", weights["ng"])
            lam = 1.0 if cfg.lam == "dynamic" else float(cfg.lam)
            total, parts["ngram"] = total + lam * term, float(term.detach())
        return total, parts

    def _weights(self, e: Example) -> dict[str, torch.Tensor]:
        """Each loss term's row weights in `e`: "kl" its direct rows, "rows" the same unweighted,
        "ng" its n-gram rows (or, for the approximate KL, its n-gram tokens)."""
        cfg = self.config
        rows = torch.ones(len(e.kl_rows))
        kl = position_weights(e.kl_pos, cfg.beta, cfg.draft_len) if cfg.beta > 0 else rows
        if cfg.ngram_loss == "approx_kl":
            return {"kl": kl, "rows": rows, "ng": torch.ones(e.ng_logp.numel())}
        ng = e.ng_logp[e.ng_group].exp() if cfg.lam == "dynamic" else torch.ones(len(e.ng_tokens))
        if cfg.beta > 0:
            ng = ng * position_weights(e.ng_pos, cfg.beta, cfg.draft_len)
        return {"kl": kl, "rows": rows, "ng": ng}

    def _ngram_term(self, part: list[Example], logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([e.ng_tokens for e in part])
        if self.config.ngram_loss == "approx_kl":
            shift = torch.tensor([0] + [e.ng_logp.numel() for e in part[:-1]]).cumsum(0)
            group = torch.cat([e.ng_group + s for e, s in zip(part, shift)])
            return ngram_approx_kl(logits, tokens, group, torch.cat([e.ng_logp for e in part]))
        return ngram_nll(logits, tokens, weights)

    @contextmanager
    def _stoppable(self, stop: Callable[[], bool] | None) -> Iterator[None]:
        """While inside, every decoder layer's forward and backward first asks `stop`."""
        if stop is None:
            yield
            return

        def check(*_: Any) -> None:
            if stop():
                raise Preempted

        layers = list(self._base().model.layers)
        handles = [layer.register_forward_pre_hook(check) for layer in layers]
        # (backward: the first layer's turn is the last, and its inputs need no gradient)
        handles += [layer.register_full_backward_pre_hook(check) for layer in layers[1:]]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _base(self) -> Any:
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @torch.no_grad()
    def agreement(self, example: Example, stop: Callable[[], bool] | None = None) -> tuple[int, int]:
        """(right, positions) at `example`'s direct positions: where the model's top-1, with
        whatever adapter is active, is the committed token (what greedy verification accepts). One
        forward over the example, no gradient, dropout off; `stop` as for `accumulate`."""
        if not len(example.kl_rows):
            return 0, 0
        base = self._base()
        training = base.training
        base.eval()
        try:
            with self._stoppable(stop):
                hidden = base.model(input_ids=example.ids[None]).last_hidden_state[0]
            top = base.lm_head(hidden[example.kl_rows]).argmax(-1)
        finally:
            base.train(training)
        return int((top == example.ids[example.kl_rows + 1]).sum()), len(example.kl_rows)

    def _logits(self, batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits of every labelled row of the right-padded batch: all (R, Vd), then the direct
        rows (A, Vd) and the n-gram rows (B, Vd), each in batch order."""
        width = max(len(e.ids) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, e in enumerate(batch):
            ids[b, : len(e.ids)], mask[b, : len(e.ids)] = e.ids, 1
        base = self._base()
        hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state.flatten(0, 1)
        kl = torch.cat([e.kl_rows + b * width for b, e in enumerate(batch)])
        ng = torch.cat([e.ng_rows + b * width for b, e in enumerate(batch)])
        logits = base.lm_head(hidden[torch.cat([kl, ng])])  # only rows a loss reads: the wide head is costly
        return logits, logits[: len(kl)], logits[len(kl) :]
