"""Sparse mixture-of-experts decoders: Qwen3-MoE and Mixtral.

Same decoder as `llama.py`; the MLP of the sparse layers is a router plus experts whose
weights are stacked along a leading expert axis, so an expert-parallel rank would own a
contiguous slice [E0:E1] of each tensor:

  mlp.gate.weight                 [E, H]      router
  mlp.experts.gate_up_proj        [E, 2I, H]  rows 0..I are gate_proj, I..2I up_proj
  mlp.experts.down_proj           [E, H, I]

The loader stacks the per-expert checkpoint tensors (`experts.N.gate_proj.weight`, Mixtral's
`w1/w3/w2`) into this layout.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from typing import TYPE_CHECKING

from engine.models.layers import GatedMLP
from engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.dp import DpGroup


class StackedExperts(nn.Module):
    """SwiGLU experts held as [E, ...] tensors: all E, or (expert-parallel) experts
    [first, first + num_experts) of them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.first = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def keep(self, first: int, last: int) -> None:
        """Hold only experts [first, last) (expert parallelism); the others' pairs contribute 0 here."""
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[first:last].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.data[first:last].clone(), requires_grad=False)
        self.first, self.num_experts = first, last - first
        self.__dict__.pop("native_weights", None)          # packed from the experts held before

    @functools.cached_property
    def native_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as the kernels' moe_experts reads them fastest: each expert's matrix packed
        for the vector or tile products where they run (NativeLinear.native_weight), else the stacks as held."""
        return self.kernels.pack_float(self.gate_up_proj), self.kernels.pack_float(self.down_proj)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, K] -> sum over the k pairs whose expert this module holds
        of weights[t, k] * expert_{ids[t, k]}(x[t])."""
        if x.device.type != "cpu":
            return self.forward_masked(x, expert_ids, weights)
        if self.kernels is not None:       # the grouped path in one native call
            return self.kernels.moe_experts(x, expert_ids, weights, *self.native_weights, self.first)
        return self.forward_grouped(x, expert_ids, weights)

    def forward_grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert so each expert runs one matmul on its contiguous slice (the host
        reads the per-expert counts: free on the CPU)."""
        top_k = expert_ids.shape[1]
        flat_experts = expert_ids.reshape(-1) - self.first
        order = torch.argsort(flat_experts, stable=True)            # pairs grouped by expert
        held = flat_experts[order]
        order = order[(held >= 0) & (held < self.num_experts)]       # (all of them unless expert-parallel)
        pair_tokens = order // top_k
        counts = torch.bincount(flat_experts[order], minlength=self.num_experts).tolist()
        inputs = x[pair_tokens]
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                outputs[rows] = F.linear(self.swiglu(F.linear(inputs[rows], self.gate_up_proj[expert])),
                                         self.down_proj[expert])
            start += count
        weighted = outputs * weights.reshape(-1)[order, None].to(outputs.dtype)
        return torch.zeros_like(x).index_add_(0, pair_tokens, weighted)

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_masked(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """On accelerators: no host sync (and fixed shapes, for graphs): every held expert reads every
        row and its output is weighted by the row's weight for it (0 when not routed there). More
        arithmetic than the grouped path; no data-dependent sizes."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            routed = ((expert_ids == expert + self.first) * weights).sum(dim=-1, keepdim=True).to(x.dtype)
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            out += routed * F.linear(F.silu(gate) * up, self.down_proj[expert])
        return out


class SparseMoeBlock(nn.Module):
    """Router softmax over all experts, top-k, optional renormalisation of the k weights."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden, intermediate)
        self.dp: DpGroup | None = None         # expert-parallel over a DP-attention group (engine/dp.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp is None:
            return self.mix(x)
        rows, offset = self.dp.gather_rows(x)          # every rank's tokens
        return self.dp.sum_rows(self.mix(rows), offset, x.shape[0])

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Route x's rows and apply the experts this module holds."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, expert_ids, weights)


def shard_experts(model: nn.Module, dp: "DpGroup") -> int:
    """Expert parallelism over a DP-attention group: every MoE block keeps its share of the experts
    and exchanges tokens with the group. Returns the blocks sharded (0: a dense model)."""
    from engine.dp import expert_range
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.experts.keep(*expert_range(block.experts.num_experts, dp.rank, dp.size))
        block.dp = dp
    model.dp = dp
    return len(blocks)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 (qk-norm) with MoE on layers where (i + 1) % decoder_sparse_step == 0, except
    those in mlp_only_layers, which keep a dense MLP of intermediate_size."""

    qk_norm = True

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
                  and config.num_experts > 0 and (layer_id + 1) % step == 0)
        if not sparse:
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))


class MixtralForCausalLM(LlamaForCausalLM):
    """Every layer sparse; the top-k weights are always renormalised."""

    # HF Mixtral checkpoints name the MoE block and its expert projections differently.
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                          (".w2.", ".down_proj."))

    def attention_biases(self, config) -> tuple[bool, bool]:
        return False, False

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                              config.num_experts_per_tok, renormalize=True)
