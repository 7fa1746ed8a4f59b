"""Online cross-vocabulary distillation (OmniDraft §3.2): losses, buffer, trainer, learner and the
per-pairing LoRA adapters."""
