"""Adaptive draft length: the fallback policy now; acceptance heads (OmniDraft §3.3) next."""
