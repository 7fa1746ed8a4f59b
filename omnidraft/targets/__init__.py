"""Targets: engines that verify drafts (vLLM here; the torch, llama.cpp and remote targets
still live beside the code that grew them)."""
