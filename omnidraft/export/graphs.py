"""The ONNX export graph of a Llama- or Gemma 3-architecture drafter, with its KV cache as inputs
and outputs.

The graph is a plain re-statement of the model's forward (Llama: RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU; Gemma 3 adds its (1 + w) norms around attention and MLP, per-head
q/k norms, sliding-window layers with their own rotary base, GELU) over explicit tensors, so
`torch.onnx.export` sees nothing but tensor ops:

    inputs   input_ids (1, n) int64, past_key_i / past_value_i (1, kv_heads, P, head_dim) per layer
    outputs  logits (1, V') of the last position, hidden (1, d) the last position's final hidden
             state (what an acceptance head reads), present_key_i / present_value_i (1, kv_heads, P+n,
             head_dim)

n and P are dynamic axes; rolling back a rejected draft is slicing the present tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["HEADS", "Gemma3Graph", "LlamaGraph", "drafter_graph"]

HEADS = ("inside", "outside", "gather")


class LlamaGraph(nn.Module):
    """The Llama forward of `model` (an HF LlamaForCausalLM, adapters merged) over explicit KV tensors."""

    inv_freq: torch.Tensor
    layers: Any  # the HF decoder layers, whose submodules differ by architecture

    def __init__(
        self,
        model: Any,
        keep_ids: Sequence[int] | None = None,
        *,
        head: str = "inside",
        int8_rows: bool = False,
    ) -> None:
        super().__init__()
        cfg = model.config
        if cfg.model_type != "llama":
            raise ValueError(
                f"ONNX export supports Llama-architecture drafters; this one is {cfg.model_type!r}"
            )
        rope = getattr(cfg, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(cfg, "rope_theta", 10000.0),
        }
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"ONNX export supports default rotary embeddings, not {rope.get('rope_type')!r}")
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.layers = nn.ModuleList(layer for layer in model.model.layers)
        self.embed, self.norm = model.model.embed_tokens, model.model.norm
        self._init_head(model, keep_ids, head, int8_rows)
        theta = float(rope["rope_theta"])
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _init_head(self, model: Any, keep_ids: Sequence[int] | None, head: str, int8_rows: bool) -> None:
        """`head`: "inside", logits of every row (or of `keep_ids`); "outside", none (the graph ends
        at the hidden state); "gather", logits of the rows a `support` input names, gathered from
        the head's int8 rows and per-row scales (`int8_rows`, the values `int8.quantize_int8` gives
        the head outside) or from its fp32 rows."""
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.head = head
        weight = model.lm_head.weight.detach()
        if head == "inside":
            weight = weight[torch.as_tensor(list(keep_ids))] if keep_ids is not None else weight
            # (d, V'): a parameter, so the exporter writes an initializer the int8 quantizer can see
            # (a buffer became a Constant node that stayed fp32: a pruned head drafted slower than the full
            # one)
            self.lm_head_t = nn.Parameter(weight.T.contiguous(), requires_grad=False)
        elif head == "gather":
            from ..runtime.int8 import int8_rows as quantized_rows

            rows, scales = quantized_rows(weight) if int8_rows else (weight.clone(), None)
            self.head_rows = nn.Parameter(
                rows, requires_grad=False
            )  # an int8 parameter: left as is by the quantizer
            self.head_scales = None if scales is None else nn.Parameter(scales, requires_grad=False)

    def _outputs(
        self, hidden: torch.Tensor, support: torch.Tensor | None, presents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        if self.head == "outside":
            return (hidden, *presents)
        if self.head == "inside":
            return (hidden @ self.lm_head_t, hidden, *presents)
        rows = self.head_rows[support]
        if self.head_scales is None:
            return (hidden @ rows.T, hidden, *presents)
        return ((hidden @ rows.float().T) * self.head_scales[support], hidden, *presents)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        support, past = (inputs[0], inputs[1:]) if self.head == "gather" else (None, inputs)
        n, p = input_ids.shape[1], past[0].shape[2]
        positions = torch.arange(n, dtype=torch.float32) + p
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        # causal mask over past + new: query i sees keys 0 .. p + i
        keys = torch.arange(p + n)[None, :]
        mask = torch.where(keys <= (torch.arange(n)[:, None] + p), 0.0, float("-inf"))
        x = self.embed(input_ids)
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._rms(x, layer.input_layernorm.weight)
            q = attn.q_proj(h).view(1, n, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            out = self._attend(q, k, v, past[2 * i : 2 * i + 2], mask, self.head_dim**-0.5, presents)
            x = x + attn.o_proj(out)
            h = self._rms(x, layer.post_attention_layernorm.weight)
            x = x + mlp.down_proj(nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        hidden = self._rms(x[:, -1], self.norm.weight)
        return self._outputs(hidden, support, presents)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        past: Sequence[torch.Tensor],
        mask: torch.Tensor,
        scale: float,
        presents: list[torch.Tensor],
    ) -> torch.Tensor:
        """The new queries over the layer's past + new keys (grouped-query); appends the layer's
        present key and value to `presents`; returns (1, n, heads * head_dim)."""
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        presents += [k, v]
        group = self.heads // self.kv_heads
        kk = k.repeat_interleave(group, dim=1) if group > 1 else k
        vv = v.repeat_interleave(group, dim=1) if group > 1 else v
        scores = q @ kk.transpose(2, 3) * scale + mask
        return (
            (torch.softmax(scores, dim=-1) @ vv)
            .transpose(1, 2)
            .reshape(1, q.shape[2], self.heads * self.head_dim)
        )

    def empty_past(self) -> list[torch.Tensor]:
        return [torch.zeros(1, self.kv_heads, 0, self.head_dim) for _ in range(2 * len(self.layers))]


class Gemma3Graph(LlamaGraph):
    """Gemma 3's text forward of `model` (an HF Gemma3ForCausalLM, adapters merged) over explicit
    KV tensors. Sliding-window layers keep every position and mask the ones outside the window (as
    the PyTorch drafter's cache does, causal_runner.py), so one rollback rule serves every layer."""

    inv_freq_sliding: torch.Tensor
    inv_freq_full: torch.Tensor

    def __init__(
        self,
        model: Any,
        keep_ids: Sequence[int] | None = None,
        *,
        head: str = "inside",
        int8_rows: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        cfg = model.config
        if cfg.model_type != "gemma3_text":
            raise ValueError(f"Gemma3Graph needs a Gemma 3 text model; this one is {cfg.model_type!r}")
        if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
            raise ValueError("ONNX export does not support Gemma's logit soft-capping")
        ropes = cfg.rope_parameters
        if any(ropes[kind].get("rope_type", "default") != "default" for kind in set(cfg.layer_types)):
            raise ValueError(f"ONNX export supports default rotary embeddings, not {ropes}")
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.eps, self.scaling, self.window = (
            cfg.rms_norm_eps,
            cfg.query_pre_attn_scalar**-0.5,
            cfg.sliding_window,
        )
        self.sliding = [kind == "sliding_attention" for kind in cfg.layer_types]
        self.layers = nn.ModuleList(layer for layer in model.model.layers)
        self.embed, self.norm = (
            model.model.embed_tokens,
            model.model.norm,
        )  # the embedding scales by sqrt(d) itself
        self._init_head(model, keep_ids, head, int8_rows)
        for kind in ("sliding_attention", "full_attention"):
            theta = float(ropes.get(kind, ropes.get("full_attention"))["rope_theta"])
            inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
            self.register_buffer(f"inv_freq_{kind.split('_')[0]}", inv, persistent=False)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + weight)

    def forward(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        support, past = (inputs[0], inputs[1:]) if self.head == "gather" else (None, inputs)
        n, p = input_ids.shape[1], past[0].shape[2]
        positions = torch.arange(n, dtype=torch.float32) + p
        rope = []
        for inv in (self.inv_freq_sliding, self.inv_freq_full):
            freqs = positions[:, None] * inv[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            rope.append((emb.cos()[None, None], emb.sin()[None, None]))
        keys, query = torch.arange(p + n)[None, :], torch.arange(n)[:, None] + p
        causal = keys <= query  # a sliding layer's query also sees only the last `window` keys
        masks = [
            torch.where(causal & (keys > query - self.window), 0.0, float("-inf")),
            torch.where(causal, 0.0, float("-inf")),
        ]
        x = self.embed(input_ids)
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn, mlp, local = layer.self_attn, layer.mlp, 0 if self.sliding[i] else 1
            cos, sin = rope[local]
            h = self._rms(x, layer.input_layernorm.weight)
            q = self._rms(
                attn.q_proj(h).view(1, n, self.heads, self.head_dim).transpose(1, 2), attn.q_norm.weight
            )
            k = self._rms(
                attn.k_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2), attn.k_norm.weight
            )
            v = attn.v_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            out = self._attend(q, k, v, past[2 * i : 2 * i + 2], masks[local], self.scaling, presents)
            x = x + self._rms(attn.o_proj(out), layer.post_attention_layernorm.weight)
            h = self._rms(x, layer.pre_feedforward_layernorm.weight)
            h = mlp.down_proj(nn.functional.gelu(mlp.gate_proj(h), approximate="tanh") * mlp.up_proj(h))
            x = x + self._rms(h, layer.post_feedforward_layernorm.weight)
        hidden = self._rms(x[:, -1], self.norm.weight)
        return self._outputs(hidden, support, presents)


def drafter_graph(
    model: Any, keep_ids: Sequence[int] | None = None, *, head: str = "inside", int8_rows: bool = False
) -> LlamaGraph:
    """The export graph for `model`'s architecture (Llama or Gemma 3)."""
    kind = model.config.model_type
    if kind == "gemma3_text":
        return Gemma3Graph(model, keep_ids, head=head, int8_rows=int8_rows)
    if kind != "llama":
        raise ValueError(f"ONNX export supports Llama and Gemma 3 drafters; this one is {kind!r}")
    return LlamaGraph(model, keep_ids, head=head, int8_rows=int8_rows)
