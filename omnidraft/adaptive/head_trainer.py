"""Training the acceptance head from verified rounds: weighted BCE on acceptance labels.

Labels (greedy): the drafted tokens the target kept are 1, the first one it did not keep is 0, and
the tokens after it are unlabelled (the head predicts acceptance given the previous ones were
accepted). Under rejection sampling the soft label min(1, p/q') applies; this engine's greedy
verification gives hard labels. The loss weights the two classes by the inverse of their frequency
over every row the trainer has seen (SpecDec++: rejections are rarer per token and cost more when
missed); the head stores the matching logit shift, so its `prob` stays calibrated, which the
cost-aware stopping rule needs (it multiplies the probabilities).

Two schedules (OmniDraft Algorithms 3 and 4):
- "joint": every adapter update also takes head steps, on the rounds since the last update only;
- "interleaved": the head keeps its own replay buffer (bounded, oldest out) and takes `steps`
  minibatch steps from all of it every `interval` requests.
Features are the drafter's hidden states at draft time (no extra forward); the head's loss does not
flow into the adapter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .acceptance_head import AcceptanceHead, HeadConfig

__all__ = ["HeadTrainer", "round_labels"]


def round_labels(drafted: int, kept: int) -> torch.Tensor:
    """Labels of one draft's tokens: 1 for the `kept` ones, 0 for the first rejected, nothing after."""
    kept = min(kept, drafted)
    return torch.tensor([1.0] * kept + ([0.0] if kept < drafted else []))


class HeadTrainer:
    """Buffer of (features, label) rows and the head's optimizer."""

    def __init__(self, head: AcceptanceHead, config: HeadConfig) -> None:
        self.head, self.config = head, config
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.01)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.features: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.rows = 0  # rows in the buffer
        self.fresh = 0  # rows added since the last update
        self.seen = 0  # labelled rows over the trainer's life
        self.accepted = 0  # positive rows among them
        self.trained = 0  # labelled rows seen as of the last update (persisted with the head)
        self.requests = 0
        self.steps = 0

    def add(self, features: torch.Tensor, kept: int) -> None:
        """One round: the features of its drafted tokens and how many of them the target kept."""
        labels = round_labels(len(features), kept)
        if len(labels):
            self.add_rows(features[: len(labels)], labels)

    def add_rows(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Labelled rows as they are (one round's, already cut after its first rejection)."""
        self.features.append(features.detach().float())
        self.labels.append(labels)
        self.fresh += len(labels)
        self.seen += len(labels)
        self.accepted += int(labels.sum())
        self.rows += len(labels)
        while self.rows > self.config.capacity:
            self.rows -= len(self.labels[0])
            self.features.pop(0)
            self.labels.pop(0)

    def end_request(self) -> dict[str, Any] | None:
        """Call after each request; runs the interleaved schedule's update when it is due."""
        self.requests += 1
        if self.config.train == "interleaved" and self.requests % self.config.interval == 0:
            return self.update()
        return None

    def update(self) -> dict[str, Any] | None:
        """`steps` minibatch steps (joint: on the fresh rows only). None if there is nothing to learn."""
        if not self.labels or self.config.steps == 0:
            return None
        x, y = torch.cat(self.features), torch.cat(self.labels)
        if self.config.train == "joint":
            x, y = x[-self.fresh :], y[-self.fresh :]
        if not self.fresh or len(y) == 0:
            return None
        positive = float(y.mean())
        # inverse class frequency (normalised so balanced classes get weight 1), from the trainer's
        # whole history so the weights, and the shift that undoes them, stay put from one update to the next
        rate = min(max(self.accepted / self.seen, 1e-3), 1 - 1e-3)
        w_pos, w_neg = 0.5 / rate, 0.5 / (1 - rate)
        self.head.shift_prior(math.log(w_pos / w_neg))
        self.head.train()
        total = 0.0
        for _ in range(self.config.steps):
            idx = torch.randint(len(y), (min(self.config.batch_size, len(y)),), generator=self.generator)
            logits = self.head(x[idx])
            weight = torch.where(y[idx] > 0.5, w_pos, w_neg)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[idx], weight=weight)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        self.head.eval()
        self.steps += self.config.steps
        self.fresh = 0
        self.trained = self.seen
        return {"head_loss": total / self.config.steps, "head_rows": len(y), "head_positive": positive}

    def evaluate(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Accuracy and mean BCE of the head on held-out rows."""
        with torch.no_grad():
            logits = self.head(features) - self.head.prior_shift  # calibrated, as `prob` sees them
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            accuracy = ((logits > 0).float() == labels).float().mean()
        return {"bce": float(loss), "accuracy": float(accuracy)}
