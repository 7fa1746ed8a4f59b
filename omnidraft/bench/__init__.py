"""Benchmarks: prompts, same-process baselines (target alone, HF assisted generation), reports."""
