"""EAGLE-1 draft head in SGLang's `LlamaForCausalLMEagle` layout.

  x   = fc(cat([embed(ids), hidden]))      fc.weight [H, 2H], fc.bias [H]
  out = decoder_layer_0(x)                 a Llama layer; no input_layernorm unless the checkpoint has one
  logits = lm_head(out)                    no final norm

`hidden` is the target's final-normed hidden state for the first draft step and the head's
own `out` afterwards. embed_tokens / lm_head come from the checkpoint when it has them,
otherwise `bind_target` shares the target's.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionBatch
from engine.models.base import CausalLM, DraftHead
from engine.models.layers import (GatedMLP, RotaryEmbedding, check_dense_attention, head_dim_of, linear_parts,
                                  rope_parameters, whole_blocks)
from engine.models.llama import DecoderLayer, make_attention


class LlamaForCausalLMEagle(DraftHead):
    # Weights a checkpoint may lack; the loader calls drop_weights() with the ones it lacks.
    optional_weights = ("embed_tokens.weight", "lm_head.weight", "fc.bias", "layers.0.input_layernorm.weight")

    def __init__(self, config):
        super().__init__()
        check_dense_attention(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        hidden = config.hidden_size
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.rotary = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        bias = bool(getattr(config, "attention_bias", False))
        layer = DecoderLayer(make_attention(config, 0, bias, bias, qk_norm=False),
                             GatedMLP(hidden, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False))),
                             hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.lm_head: nn.Linear | None = nn.Linear(hidden, config.vocab_size, bias=False)
        self.lm_head_shared: torch.Tensor | None = None

    def drop_weights(self, names: set[str]) -> None:
        """Forget the optional modules the checkpoint did not provide."""
        if "embed_tokens.weight" in names:
            self.embed_tokens = None
        if "lm_head.weight" in names:
            self.lm_head = None
        if "fc.bias" in names:
            self.fc.bias = None
        if "layers.0.input_layernorm.weight" in names:
            self.layers[0].input_layernorm = None

    def bind_target(self, target: CausalLM) -> None:
        if target.hidden_size != self.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.embed_tokens is None:
            self.embed_tokens = target.embed_tokens
        if self.lm_head is None:
            self.lm_head_shared = target.lm_head_weight().detach()  # a view, not a parameter of the head

    def kv_layout(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return 1, attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        return self.layers[0](x, self.rotary(batch, x.dtype), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_to_vocab(hidden).float()

    def draft_chain(self, first: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, table: torch.Tensor,
                    kv, steps: int, keep: torch.Tensor,
                    threshold: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chain forward -> compute_logits -> top_choice would draft step by step, in one native
        call (devices/native/draft.cpp: eagle_chain): step i reads the last draft and output at
        position start + i - 1 of each row; a row keeps verifying while its drafts' probabilities
        stay >= threshold, and the chain ends before a draft no row keeps. Where the kernels cannot
        run the whole head (no kernels, a token map, a layer module by module, a cache of another
        dtype): None."""
        parts = self.native_chain_parts(kv)
        if parts is None:
            return None
        return self.kernels.eagle_chain(first, hidden, start, table, kv.k[0], kv.v[0], steps, keep, threshold, *parts)

    def extend_native(self, tokens: torch.Tensor, features: torch.Tensor, batch: AttentionBatch,
                      pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """forward over the verified tokens -> the rows `pick` -> compute_logits -> top_choice in one
        native call (devices/native/draft.cpp: eagle_extend); None where draft_chain's is None."""
        parts = self.native_chain_parts(batch.kv)
        if parts is None:
            return None
        seqs, kv = batch.layout, batch.kv
        return self.kernels.eagle_extend(tokens, features, seqs.q_start, seqs.q_lens, seqs.kv_lens, seqs.rows,
                                         seqs.table, kv.k[0], kv.v[0], pick, *parts)

    def native_chain_parts(self, kv) -> tuple | None:
        """The head's tensors and scalars in eagle_chain's and eagle_extend's order, where the kernels
        run it whole. Built once for the kernels, token map, LM head and cache dtype the head has: a
        speculative step reads them twice, and a build took 12-22 µs (an AMD EPYC, 2 cores)."""
        key = (self.kernels, self.hot_ids, self.lm_head_weight(), self._modules.get("lm_head_quantized"), kv.k[0].dtype)
        held = self.__dict__.get("native_parts_of")
        if held is None or any(now is not then for now, then in zip(key, held[0])):
            held = (key, self.build_native_parts(kv.k[0].dtype))
            self.__dict__["native_parts_of"] = held
        return held[1]

    def build_native_parts(self, cache_dtype: torch.dtype) -> tuple | None:
        layer = self.layers[0]
        weights = layer.native_weights if self.kernels is not None else None
        if (weights is None or self.hot_ids is not None or self.embed_tokens is None
                or cache_dtype != self.embed_tokens.weight.dtype or self.lm_head_weight().shape[0] % 16
                or not whole_blocks(self.fc)):
            return None           # (a chain's choice reads every packed output: whole blocks of 16 only)
        quantized = self._modules.get("lm_head_quantized")
        head_w, head_s = ((quantized.packed, quantized.scale) if quantized is not None
                          else (self.native_lm_head(), None))
        fc_w, fc_b, fc_s = linear_parts(self.fc)
        return (self.embed_tokens.weight, self.rotary.inv_freq.float(), fc_w, fc_b, fc_s, head_w, head_s,
                *weights)
