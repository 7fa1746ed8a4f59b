"""Online cross-vocabulary distillation (OmniDraft §3.2): losses now; buffer and trainer next."""
