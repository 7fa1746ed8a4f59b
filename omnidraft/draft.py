"""The drafting types every drafter backend shares: `Draft`, what one `propose` returns.

No model and no tokenizer here: the PyTorch drafter (drafter.py), the ONNX Runtime one
(export/ort_drafter.py) and the pairing loop all import it from this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Draft", "NO_DRAFT"]


@dataclass(frozen=True)
class Draft:
    """Drafted ids (K,) and, when sampling, the distributions they were drawn from: q (K, Vd).
    `healed`: the first id replaces the context's last token (token healing, translate/healing.py),
    so the draft's bytes begin with that token's, which were already committed."""

    ids: list[int]
    q: torch.Tensor | None = None
    healed: bool = False


NO_DRAFT = Draft([])  # a round that does not speculate: the target decodes one token alone
