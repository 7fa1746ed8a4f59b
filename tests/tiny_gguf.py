"""A tiny Llama written as a GGUF file that llama.cpp runs and transformers reads back: the fast
tier's llama.cpp target and drafter (no shipped model needed). Weights in F32; q and k permuted
for llama.cpp's rotary layout as llama.cpp's own converter does, so both engines compute the same
model; the byte-level BPE tokenizer as a "gpt2" vocabulary with its merges."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs, per head (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model, tokenizer, path: Path) -> Path:
    """`model` (a LlamaForCausalLM) and `tokenizer` (byte-level BPE, fast) as one GGUF file."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_bos_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(False)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        for hf, ours in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif ours == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
