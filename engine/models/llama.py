"""The dense decoder: Llama, Qwen2 and Qwen3 are one implementation with three flags.

  Llama   attention_bias (q/k/v/o) and mlp_bias from the config
  Qwen2   bias on q/k/v, none on o
  Qwen3   RMSNorm on each q/k head before the rotary embedding (qk-norm)

Parameter names match the HF checkpoints without their `model.` prefix:
embed_tokens, layers.N.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}, norm,
lm_head (absent when tie_word_embeddings: the LM head then reads embed_tokens.weight).
MoE models (`moe.py`) reuse this class and only replace `make_mlp`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from engine.models.attention import AttentionBatch
from engine.models.base import CausalLM, ModelOutput
from engine.models.layers import (Attention, GatedMLP, RMSNorm, Rope, RotaryEmbedding, check_dense_attention,
                                  config_value, head_dim_of, linear_parts, rope_parameters, whole_blocks)


class NativeLayer(NamedTuple):
    """What the native kernels' dense_layer reads of a layer: its tensors in the kernels' order
    (input_norm, post_norm, qkv w/b/s, o w/b/s, gate_up w/b/s, down w/b/s, q_norm, k_norm; absent ones
    None), then the scalars (`scalars`: every layer of a stack must share them)."""
    tensors: list
    eps: float
    qk_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @property
    def scalars(self) -> tuple:
        return self[1:]


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    `input_layernorm=False` leaves the attention input un-normalized (EAGLE-1 layer 0)."""

    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float, input_layernorm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps) if input_layernorm else None
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
        weights = self.native_weights
        if weights is not None and self.self_attn.native_fits(x, batch):
            return self.run_native(x, rope, batch, weights)
        normed = self.input_layernorm(x) if self.input_layernorm is not None else x
        h, normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, rope, batch))
        return h + self.mlp(normed)


    @functools.cached_property
    def native_weights(self) -> NativeLayer | None:
        """What the native kernels' dense_layer reads; None: the layer runs module by module (no native
        kernels, an MoE block, projections not stacked)."""
        attn, mlp = self.self_attn, self.mlp
        if (attn.kernels is None or not isinstance(mlp, GatedMLP) or attn.qkv_proj is None
                or mlp.gate_up_proj is None):
            return None
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(whole_blocks(m) for m in modules):
            return None
        norm_in = self.input_layernorm.weight if self.input_layernorm is not None else None
        post = self.post_attention_layernorm
        linears = [linear_parts(m) for m in modules]
        q_norm, k_norm, qk_eps = ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                                  if attn.q_norm is not None else (None, None, 0.0))
        tensors = [norm_in, post.weight, *(t for parts in linears for t in parts), q_norm, k_norm]
        return NativeLayer(tensors, post.eps, qk_eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)

    def run_native(self, x: torch.Tensor, rope: Rope, batch: AttentionBatch, weights: NativeLayer) -> torch.Tensor:
        attn, seqs, kv = self.self_attn, batch.layout, batch.kv
        return attn.kernels.dense_layer(x, rope.native(attn.kernels, x.shape[0]), kv.k[attn.layer_id],
                                        kv.v[attn.layer_id], seqs.q_start, seqs.q_lens, seqs.kv_lens, seqs.rows,
                                        seqs.table, *weights)


def make_attention(config, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                   input_size: int | None = None) -> Attention:
    return Attention(hidden=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config_value(config, "num_key_value_heads", config.num_attention_heads),
                     head_dim=head_dim_of(config), layer_id=layer_id, input_size=input_size,
                     qkv_bias=qkv_bias, o_bias=o_bias, qk_norm_eps=config.rms_norm_eps if qk_norm else None)


class LlamaForCausalLM(CausalLM):
    """Llama-style decoder over the paged KV cache."""

    qk_norm = False

    def __init__(self, config):
        super().__init__()
        check_dense_attention(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        qkv_bias, o_bias = self.attention_biases(config)
        self.layers = nn.ModuleList(
            DecoderLayer(make_attention(config, i, qkv_bias, o_bias, self.qk_norm), self.make_mlp(config, i),
                         config.hidden_size, config.rms_norm_eps)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (None if self.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.aux_layer_ids: list[int] = []

    # -- flags the subclasses change
    def attention_biases(self, config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))

    # -- the CausalLM contract
    @property
    def ignored_weights(self) -> set[str]:
        """Checkpoint tensors the loader may skip: a tied model's redundant lm_head copy."""
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def kv_layout(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return self.num_layers, attn.num_kv_heads, attn.head_dim

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_aux_capture_layers(self, layer_ids: list[int]) -> None:
        """Capture the residual stream entering each layer in `layer_ids`; id == num_layers means
        the stream after the last layer (before the final norm)."""
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux capture layers {bad} outside 0..{self.num_layers}")
        self.aux_layer_ids = list(layer_ids)

    dp = None           # a DP-attention group (engine/dp.py) when the MoE layers are expert-parallel

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, capture_aux: bool = False) -> ModelOutput:
        if self.dp is None:
            return self.run_layers(input_ids, batch, capture_aux)
        with self.dp.forward_rows(input_ids.shape[0]):      # the group's token counts, for the MoE layers
            return self.run_layers(input_ids, batch, capture_aux)

    def run_layers(self, input_ids: torch.Tensor, batch: AttentionBatch, capture_aux: bool) -> ModelOutput:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(batch, x.dtype)
        wanted = set(self.aux_layer_ids) if capture_aux else set()
        captured: dict[int, torch.Tensor] = {}
        stack = self.native_stack
        if stack is not None and not wanted and self.layers[0].self_attn.native_fits(x, batch):
            x = stack(x, rope, batch)
        for i, layer in enumerate(self.layers if stack is None or wanted else ()):
            if i in wanted:
                captured[i] = x
            x = layer(x, rope, batch)
        if self.num_layers in wanted:
            captured[self.num_layers] = x
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if captured else None
        return ModelOutput(hidden=self.norm(x), aux_hidden=aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_to_vocab(hidden).float()

    @functools.cached_property
    def native_stack(self):
        """Every layer in one native call (dense_layers), where every layer runs dense_layer with the
        same scalars: the stream then runs the whole stack without the GIL, and the rank loop's
        Python runs meanwhile instead of between layers. None: layer by layer."""
        weights = [layer.native_weights for layer in self.layers]
        if not weights or any(w is None for w in weights):
            return None
        scalars = {w.scalars for w in weights}
        if len(scalars) != 1:
            return None
        (eps, qk_eps, heads, kv_heads, head_dim, scale), = scalars
        tensors = [w.tensors for w in weights]
        kernels = self.layers[0].self_attn.kernels

        def run(x: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
            seqs, kv = batch.layout, batch.kv
            return kernels.dense_layers(x, rope.native(kernels, x.shape[0]), kv.k, kv.v, seqs.q_start, seqs.q_lens,
                                        seqs.kv_lens, seqs.rows, seqs.table, tensors, eps, qk_eps, heads, kv_heads,
                                        head_dim, scale)
        return run


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
