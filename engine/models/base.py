"""The contract every model in `engine/models/` keeps, and the architecture registry.

A target model maps a flattened batch of new tokens to hidden states, writing
their K/V into the paged cache through `AttentionBatch`; logits are computed
separately, only for the rows that need them (last token of each sequence, or
every verify row). Draft heads (EAGLE, EAGLE-3) take the target's hidden states
as a second input and borrow the target's embeddings / LM head via `bind_target`.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionBatch


class ModelOutput(NamedTuple):
    hidden: torch.Tensor                   # [T, hidden] after the final norm (what the LM head reads)
    aux_hidden: torch.Tensor | None = None  # [T, 3*hidden] residual stream at the EAGLE-3 capture layers


class VocabProjection:
    """The LM head's product, through the submodule `lm_head_quantized` when the model is quantized
    (engine/models/quant.py: quantize_lm_head), else through the native CPU kernels' `linear` on the
    packed weight when the model runs them, else torch's product."""

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def project_to_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        quantized = self._modules.get("lm_head_quantized")
        if quantized is not None:
            return quantized(hidden)
        if self.kernels is not None:
            logits = self.kernels.linear(hidden, self.native_lm_head(), None)
            vocab = self.lm_head_weight().shape[0]      # packed outputs come in whole blocks of 16
            return logits if logits.shape[-1] == vocab else logits[..., :vocab]
        return F.linear(hidden, self.lm_head_weight())

    def native_lm_head(self) -> torch.Tensor:
        """lm_head_weight() as the kernels' `linear` reads it fastest (NativeLinear.native_weight),
        packed again only when the LM head itself changes (a token map, a bound target)."""
        weight = self.lm_head_weight()
        held = self.__dict__.get("native_lm_head_of")
        if held is None or held[0] is not weight:
            held = (weight, self.kernels.pack_float(weight))
            self.__dict__["native_lm_head_of"] = held
        return held[1]


class CausalLM(VocabProjection, nn.Module, ABC):
    """A target model (dense or MoE)."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                capture_aux: bool = False) -> ModelOutput:
        """Run the new tokens [T] through the model, writing their K/V into batch.kv."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: [N, hidden] -> [N, vocab] in float32."""

    @abstractmethod
    def kv_layout(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache this model needs."""

    def set_aux_capture_layers(self, layer_ids: list[int]) -> None:
        """Layers whose input residual stream forms ModelOutput.aux_hidden (EAGLE-3)."""
        self.aux_layer_ids = list(layer_ids)


class DraftHead(VocabProjection, nn.Module, ABC):
    """An EAGLE-style draft head that conditions on the target's hidden states.

    Its LM head is `lm_head` (its own) or `lm_head_shared` (the target's, bound by bind_target);
    a token map (`restrict_vocab`) keeps only the rows of frequent target tokens."""

    lm_head: nn.Linear | None
    lm_head_shared: torch.Tensor | None
    hot_ids: torch.Tensor | None = None      # token map: draft id i is target id hot_ids[i]
    # `fc` joins token embeddings (|x| ~0.3 in the embedded head) with the target's hidden states (~8),
    # or EAGLE-3's hidden states of three layers: --quantization w8a8_int8 leaves it in the model's dtype
    # (engine/models/quant.py: quantize), else the embeddings' half would quantize to a few levels
    mixed_scale_inputs = ("fc",)

    @abstractmethod
    def bind_target(self, target: CausalLM) -> None:
        """Share the target's embeddings and LM head where the checkpoint has none."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """input_ids [T], hidden [T, H_in] -> the head's output hidden state [T, H] (fed back as the
        next step's `hidden`)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, draft_vocab] float32 logits."""

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity unless the head has a reduced vocabulary)."""
        return ids if self.hot_ids is None else self.hot_ids[ids]

    def draft_chain(self, first: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, table: torch.Tensor,
                    kv, steps: int, keep: torch.Tensor,
                    threshold: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A greedy chain of `steps` drafts after `first` [B] in one native call, where the head has
        one: the drafts [B, 1 + m] and what each row kept [m, B] (see LlamaForCausalLMEagle). None:
        the caller drafts step by step."""
        return None

    def extend_native(self, tokens: torch.Tensor, features: torch.Tensor, batch, pick: torch.Tensor) -> tuple | None:
        """The head over the verified tokens, the rows `pick` of its output, and their greedy drafts
        with their probabilities, in one native call where the head has one: (hidden [B, H], drafts
        [B], probabilities [B]) (see LlamaForCausalLMEagle). None: the caller runs the modules."""
        return None

    def native_chain_parts(self, kv) -> tuple | None:
        """What draft_chain's and extend_native's native calls read besides their inputs; None: the
        head has none."""
        return None

    def lm_head_weight(self) -> torch.Tensor:
        """[draft_vocab, H]: the LM head the drafts are read from."""
        return self.lm_head.weight if self.lm_head is not None else self.lm_head_shared

    def restrict_vocab(self, hot_ids: torch.Tensor) -> None:
        """Token map (SGLang's --speculative-token-map, after FR-Spec): draft only the target tokens
        `hot_ids` [N] (sorted, unique, in range). The LM head becomes a copy of those N rows, so each
        draft step's logits cost N / vocab of the full head's; a head with its own reduced draft
        vocabulary refuses (its rows are not target ids)."""
        weight = self.lm_head_weight()
        if weight.shape[0] != self.vocab_size:
            raise ValueError(f"the head already drafts from its own vocabulary of {weight.shape[0]} tokens; "
                             f"a token map applies to heads over the target's {self.vocab_size}")
        self.hot_ids = hot_ids.to(weight.device)
        self.lm_head = None
        self.lm_head_shared = weight.detach().index_select(0, self.hot_ids).contiguous()

    @abstractmethod
    def kv_layout(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the head's own KV cache."""


# Architecture name in config.json -> "module:Class". A new model is one file plus one line here.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "engine.models.moe:MixtralForCausalLM",
    "LlamaForCausalLMEagle": "engine.models.eagle:LlamaForCausalLMEagle",
    "LlamaForCausalLMEagle3": "engine.models.eagle3:LlamaForCausalLMEagle3",
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    module, cls = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
