"""Targets in this process: `LocalTarget` (an HF model on PyTorch, local.py) and `VLLMTarget` (vLLM's
engine, vllm_target.py, with omnidraft's proposer inside its speculative step, vllm_proposer.py).
The protocol they implement is target.py; the llama.cpp target is llamacpp/llama_target.py and
the remote one remote/client.py."""
