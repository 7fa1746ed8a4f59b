"""Vocabulary translation between a drafter and a target: bytes of tokens, direct map, n-gram cache."""
