"""How much to draft: the cost model (measured drafting and verify costs), the draft-length
policies (cost policy, hysteresis), acceptance heads and their trainer (OmniDraft §3.3), and
per request whether to speculate at all (policy.py's best_speedup and mode chooser)."""
