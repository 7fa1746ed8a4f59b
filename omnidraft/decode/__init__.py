"""Speculative decoding itself (docs/architecture.md): a pairing's machinery kept across requests
(`speculator`), one request's state machine (`speculation`), its rounds against a target session
(`round_loop`), the same rounds where an engine verifies in its own step (`engine_proposals`), what
each round proposes and learns (`round_policy`, `proposers`), the acceptance maths (`verify`), the
decoding options (`config`), per-round records (`stats`) and the request helpers (`rounds`).
Nothing here loads a model.
"""
