"""EAGLE-3 draft head in SGLang's `LlamaForCausalLMEagle3` layout.

  h   = fc(aux)  if hidden is the target's concatenated aux states [T, 3H] (one H per aux
                 layer; 3 is the usual count), else hidden (the head's previous output)
  x   = cat([input_layernorm(embed(ids)), hidden_norm(h)])          [T, 2H]
  h   = h + attn(x)                                                 q/k/v read 2H
  out = h + mlp(post_attention_layernorm(h))                        fed back as the next `hidden`
  logits = lm_head(norm(out))                                       over the draft vocabulary

Draft ids map to target ids as `target = draft + d2t[draft]`. The target must capture the
outputs of layers `eagle_config.eagle_aux_hidden_state_layer_ids`, i.e. the residual stream
entering layers id + 1; `bind_target` sets that on the target.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionBatch
from engine.models.base import CausalLM, DraftHead
from engine.models.layers import (GatedMLP, RMSNorm, Rope, RotaryEmbedding, check_dense_attention, config_value,
                                  head_dim_of, rope_parameters)
from engine.models.llama import make_attention


class Eagle3MidLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = make_attention(config, 0, bias, bias, qk_norm=False, input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h, normed = self.post_attention_layernorm.add_and_norm(hidden, self.self_attn(x, rope, batch))
        return h + self.mlp(normed)


def eagle_config_value(config, name: str):
    eagle_config = getattr(config, "eagle_config", None) or {}
    if isinstance(eagle_config, dict):
        return eagle_config.get(name)
    return getattr(eagle_config, name, None)


class LlamaForCausalLMEagle3(DraftHead):
    def __init__(self, config):
        super().__init__()
        check_dense_attention(config)
        self.config = config
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config_value(config, "draft_vocab_size", config.vocab_size)
        self.target_hidden_size = config_value(config, "target_hidden_size", hidden)
        ids = eagle_config_value(config, "eagle_aux_hidden_state_layer_ids")
        # Target layers whose OUTPUT the head was trained on (None: SGLang's default choice).
        self.aux_hidden_state_layer_ids: list[int] | None = list(ids) if ids is not None else None
        self.capture_layers: list[int] | None = None    # set by bind_target (layer-input indices)

        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, hidden)
        num_aux = len(self.aux_hidden_state_layer_ids) if self.aux_hidden_state_layer_ids is not None else 3
        self.fc = nn.Linear(num_aux * self.target_hidden_size, hidden, bias=True)
        self.rotary = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.lm_head_shared: torch.Tensor | None = None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def optional_weights(self) -> tuple[str, ...]:
        """Weights a checkpoint may lack; the loader calls drop_weights() with the ones it lacks.
        A head with the full vocabulary may borrow the target's LM head and needs no d2t."""
        names = ("embed_tokens.weight", "t2d", "fc.bias")
        if self.draft_vocab_size == self.vocab_size:
            names += ("lm_head.weight", "d2t")
        return names

    def drop_weights(self, names: set[str]) -> None:
        if "embed_tokens.weight" in names:
            self.embed_tokens = None
        if "lm_head.weight" in names:
            self.lm_head = None
        if "fc.bias" in names:
            self.fc.bias = None
        for buffer in ("d2t", "t2d"):
            if buffer in names:
                setattr(self, buffer, None)

    def target_capture_layers(self, num_target_layers: int) -> list[int]:
        """Layer-input indices for target.set_aux_capture_layers: the output of layer i is the
        stream entering layer i + 1."""
        if self.aux_hidden_state_layer_ids is None:
            return [2, num_target_layers // 2, num_target_layers - 3]
        return [i + 1 for i in self.aux_hidden_state_layer_ids]

    def bind_target(self, target: CausalLM) -> None:
        """Share embeddings / LM head where the checkpoint has none, and make the target
        capture the aux hidden states this head reads."""
        if target.hidden_size != self.target_hidden_size:
            raise ValueError(f"EAGLE-3 head expects target hidden_size {self.target_hidden_size}, "
                             f"target has {target.hidden_size}")
        if self.embed_tokens is None:
            if target.hidden_size != self.hidden_size:
                raise ValueError("EAGLE-3 head has no embed_tokens and its hidden_size differs from the target's")
            self.embed_tokens = target.embed_tokens
        if self.lm_head is None:
            self.lm_head_shared = target.lm_head_weight().detach()  # a view, not a parameter of the head
        self.capture_layers = self.target_capture_layers(target.num_layers)
        target.set_aux_capture_layers(self.capture_layers)

    def kv_layout(self) -> tuple[int, int, int]:
        attn = self.midlayer.self_attn
        return 1, attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """hidden: all rows the target's aux states [T, k*H] (first draft step / draft extend) or
        all rows the head's own output [T, H]; one call never mixes the two."""
        embeds = self.embed_tokens(input_ids)
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)
        return self.midlayer(embeds, hidden, self.rotary(batch, hidden.dtype), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_to_vocab(self.norm(hidden)).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        if self.hot_ids is not None or self.d2t is None:         # a token map, or the full vocabulary
            return super().draft_to_target(ids)
        return ids + self.d2t[ids]
