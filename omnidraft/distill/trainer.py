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
from dataclasses import dataclass
from typing import Any

import torch

from .buffer import Buffer, Example
from .losses import direct_kl, ngram_approx_kl, ngram_nll, position_weights

__all__ = ["OnlineTrainer", "TrainConfig"]


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
        for name in ("interval", "batch_size", "epochs", "topk", "capacity", "draft_len"):
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
        """One optimizer step on `batch`. With another `optimizer` (Test-Time Speculation's fast
        steps) the step is not counted in `steps` or `history`: those record the lasting updates."""
        opt = optimizer or self.optimizer
        was_training = self.model.training
        self.model.train()
        try:
            total, parts = self.loss(batch)
            opt.zero_grad(set_to_none=True)
            total.backward()
            if optimizer is None:
                for group in opt.param_groups:
                    group["lr"] = self.config.lr_at(self.start_step + self.steps)
            with self.step_lock:
                opt.step()
        finally:
            self.model.train(was_training)
        if optimizer is not None:
            return {"loss": float(total.detach()), **parts}
        self.steps += 1
        log = {"step": self.steps, "loss": float(total.detach()), "lr": opt.param_groups[0]["lr"], **parts}
        self.history.append(log)
        return log

    def loss(self, batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        """The hybrid loss of one batch, and its terms as floats."""
        cfg = self.config
        logits, kl_logits, ng_logits = self._logits(batch)
        cat = lambda name: torch.cat([getattr(e, name) for e in batch])  # noqa: E731
        total, parts = logits.sum() * 0.0, {}
        if cfg.kl and len(kl_logits):
            w = position_weights(cat("kl_pos"), cfg.beta, cfg.draft_len) if cfg.beta > 0 else None
            term = direct_kl(kl_logits, cat("kl_ids"), cat("kl_logp"), self.t2d, w)
            total, parts["kl"] = total + term, float(term.detach())
        if cfg.direct_nll > 0 and len(kl_logits):
            committed = torch.cat([e.ids[e.kl_rows + 1] for e in batch])  # row r predicts ids[r + 1]
            term = ngram_nll(kl_logits, committed)
            total, parts["direct_nll"] = total + cfg.direct_nll * term, float(term.detach())
        if cfg.ngram_loss != "none" and len(ng_logits):
            term = self._ngram_term(batch, ng_logits)
            lam = 1.0 if cfg.lam == "dynamic" else float(cfg.lam)
            total, parts["ngram"] = total + lam * term, float(term.detach())
        return total, parts

    def _ngram_term(self, batch: list[Example], logits: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        tokens = torch.cat([e.ng_tokens for e in batch])
        if cfg.ngram_loss == "approx_kl":
            shift = torch.tensor([0] + [e.ng_logp.numel() for e in batch[:-1]]).cumsum(0)
            group = torch.cat([e.ng_group + s for e, s in zip(batch, shift)])
            return ngram_approx_kl(logits, tokens, group, torch.cat([e.ng_logp for e in batch]))
        weights = torch.ones(len(tokens))
        if cfg.lam == "dynamic":
            weights = torch.cat([e.ng_logp[e.ng_group].exp() for e in batch])
        if cfg.beta > 0:
            weights = weights * position_weights(
                torch.cat([e.ng_pos for e in batch]), cfg.beta, cfg.draft_len
            )
        return ngram_nll(logits, tokens, weights)

    @torch.no_grad()
    def agreement(self, example: Example) -> tuple[int, int]:
        """(right, positions) at `example`'s direct positions: where the model's top-1, with
        whatever adapter is active, is the committed token (what greedy verification accepts). One
        forward over the example, no gradient, dropout off."""
        if not len(example.kl_rows):
            return 0, 0
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        training = base.training
        base.eval()
        try:
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
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state.flatten(0, 1)
        kl = torch.cat([e.kl_rows + b * width for b, e in enumerate(batch)])
        ng = torch.cat([e.ng_rows + b * width for b, e in enumerate(batch)])
        logits = base.lm_head(hidden[torch.cat([kl, ng])])  # only rows a loss reads: the wide head is costly
        return logits, logits[: len(kl)], logits[len(kl) :]
