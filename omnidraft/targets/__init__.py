"""Target engines: `LocalTarget` (an HF model on PyTorch, local.py), `VLLMTarget` (vLLM's engine,
vllm_target.py, with omnidraft's proposer inside its speculative step, vllm_proposer.py), and the
clients of a target on a server: `RemoteTarget` (remote.py, the device side of `omnidraft serve`,
its streaming in remote_stream.py) and `OpenAICompletionsTarget` (openai_client.py, any server's
/v1/completions). The protocol they implement is target.py; the registry `serve` and `bench`
read is registry.py; the llama.cpp target is llamacpp/llama_target.py.
"""
