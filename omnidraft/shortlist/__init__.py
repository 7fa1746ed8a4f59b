"""Shortlisted drafter heads: the LM head evaluated on part of the vocabulary (FR-Spec's static
shortlist, EvoSpec's core plus recalled buffer, DynaSpec's routed clusters). `Drafter.use_shortlist`
installs one; verification is untouched. See docs/shortlists.md."""

from .shortlisted_head import ShortlistHead
from .supports import Dyna, Evo, Static

__all__ = ["Dyna", "Evo", "ShortlistHead", "Static"]
