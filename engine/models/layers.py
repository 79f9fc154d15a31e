"""Pieces shared by every decoder in `engine/models/`: RMSNorm, rotary embedding, the gated
MLP and the attention block over the paged KV cache.

All modules take flattened tokens [T, ...]; the batch structure lives in `AttentionBatch`.
Parameter names follow the Hugging Face checkpoints (q_proj, gate_proj, ...) so the loader
maps names by stripping prefixes only.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionBatch, paged_attention


def config_value(config, name: str, default=None):
    """`config.name`, treating an explicit None like a missing field."""
    value = getattr(config, name, None)
    return default if value is None else value


def head_dim_of(config) -> int:
    return config_value(config, "head_dim", config.hidden_size // config.num_attention_heads)


def check_dense_attention(config) -> None:
    """Refuse configs whose attention is not plain causal attention over the whole context."""
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    uses_window = "sliding_attention" in layer_types or (
        window is not None and getattr(config, "use_sliding_window", True)
        and window < config_value(config, "max_position_embeddings", math.inf))
    if uses_window:
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported")
    act = config_value(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")


# What a module caches from its kernels (packed weights, a layer's or the stack's native call): dropped
# whenever the kernels change, so that no forward reads what was built for others.
NATIVE_CACHES = ("native_weight", "native_bias", "native_weights", "native_lm_head_of", "native_stack",
                 "native_parts_of")


def use_cpu_kernels(model: nn.Module, kernels) -> None:
    """Run the model's norms, SwiGLU and attention through the native CPU kernels
    (devices/cpu_native.py); None: the pure-torch path. Both compute the same function."""
    from engine.models.base import VocabProjection
    from engine.models.moe import StackedExperts
    from engine.models.quant import QuantizedLinear

    for module in model.modules():
        if type(module) is nn.Linear and kernels is not None:
            module.__class__ = NativeLinear          # the same module and parameters, the native product
        if isinstance(module, NativeLinear):
            module.restore_loaded()                  # packed for the kernels it had: back to the matrix
        if isinstance(module, (RMSNorm, Attention, GatedMLP, QuantizedLinear, StackedExperts, VocabProjection,
                               NativeLinear)):
            module.kernels = kernels
        for cached in NATIVE_CACHES:                 # built for the kernels the model had, or for none
            module.__dict__.pop(cached, None)
    if kernels is not None:                                  # pack now, not in the first request's forward
        pack_native_weights(model)


def pack_native_weights(model: nn.Module) -> None:
    """Read every cached packed weight once, so the first request's forward finds them ready."""
    from engine.models.base import VocabProjection
    from engine.models.moe import StackedExperts

    lm_heads = {id(getattr(m, "lm_head", None)) for m in model.modules() if isinstance(m, VocabProjection)}
    for module in model.modules():
        if isinstance(module, NativeLinear) and id(module) not in lm_heads:
            module.keep_packed_only()
        elif isinstance(module, StackedExperts):
            _ = module.native_weights
        elif (isinstance(module, VocabProjection) and module._modules.get("lm_head_quantized") is None
              and module.lm_head_weight() is not None):      # a draft head's is bound later
            module.native_lm_head()


class NativeLinear(nn.Linear):
    """An nn.Linear whose product runs through the native CPU kernels' `linear` on its packed weight, at
    every row count (a weight the kernels do not pack goes through torch's product). use_cpu_kernels turns
    a model's nn.Linear modules into these; the layers that run in one native call (dense_layer) read
    their weights directly."""

    kernels = None

    @functools.cached_property
    def native_weight(self) -> torch.Tensor:
        """The weight as the kernels' `linear` reads it: packed once into blocks of 16 output columns
        (devices/native/products.h; outputs padded with zero columns up to whole blocks), else the weight
        itself (a shape the kernels do not pack)."""
        return self.kernels.pack_float(self.weight) if self.kernels is not None else self.weight

    def packed_format(self) -> str | None:
        """The native format its product runs in ("float32", "bfloat16"), None where torch's runs it
        (devices/cpu_native.py packed_formats asks every module)."""
        if self.kernels is None or not self.kernels.is_packed(self.native_weight):
            return None
        return str(self.native_weight.dtype).removeprefix("torch.")

    @functools.cached_property
    def native_bias(self) -> torch.Tensor | None:
        """The bias padded as native_weight's outputs are."""
        padded = padded_outputs(self.native_weight)
        if self.bias is None or padded == self.out_features:
            return self.bias
        return F.pad(self.bias, (0, padded - self.out_features))

    def keep_packed_only(self) -> None:
        """Hold the weight in its packed form only: the matrix as loaded beside it would double the memory
        of the model's layers. `weight` is an empty placeholder until the kernels are taken away
        (restore_loaded). Not for an LM head, whose matrix the embedding and draft heads read."""
        packed = self.native_weight
        if packed is not self.weight and self.weight.numel() and padded_outputs(packed) == self.out_features:
            self.weight = nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)

    def restore_loaded(self) -> None:
        """The matrix back from its packed form, where keep_packed_only let it go."""
        packed = self.__dict__.get("native_weight")
        if packed is not None and self.weight.numel() == 0 and self.kernels is not None:
            self.weight = nn.Parameter(self.kernels.unpack_float(packed), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            y = self.kernels.linear(x, self.native_weight, self.native_bias)
            return y if y.shape[-1] == self.out_features else y[..., :self.out_features]
        return F.linear(x, self.weight, self.bias)


def padded_outputs(weight: torch.Tensor) -> int:
    """The outputs a weight gives as the kernels read it: a packed float weight's whole blocks of 16."""
    if weight.dim() == 3 and weight.dtype == torch.float32:
        return weight.shape[0] * 16
    if weight.dim() == 5 and weight.dtype == torch.bfloat16:
        return weight.shape[0] * 16
    return weight.shape[0]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as HF does)."""

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + delta: a residual add and the norm after it."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return h, self(h)


# ---------------------------------------------------------------------------- rotary embedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict with at least rope_type and rope_theta.

    Accepts the transformers>=5 `rope_parameters` field and the older `rope_theta` +
    `rope_scaling` pair (plain-json EAGLE configs use the latter)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", config_value(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def rope_inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """inv_freq [head_dim / 2] in float32 for the supported rope types (on the CPU)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return llama3_scaled(inv_freq, params)
    return inv_freq


def llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    the band between interpolated smoothly."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The rotary embedding of one forward (`Rope`), shared by all layers."""

    def __init__(self, head_dim: int, params: dict):
        super().__init__()
        # Built on the CPU even when the model is constructed on `meta`; model.to(device) moves it.
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, params), persistent=False)

    def forward(self, batch: AttentionBatch, dtype: torch.dtype) -> "Rope":
        return Rope(self.inv_freq.float(), batch, dtype)


class Rope:
    """inv_freq [head_dim / 2] in float32 (what the native kernels read, with the positions from the
    batch's layout) and, built on first use, the pure-torch path's cos/sin tables [T, head_dim] for
    the batch's positions, angles computed in float32."""

    def __init__(self, inv_freq: torch.Tensor, batch: AttentionBatch, dtype: torch.dtype):
        self.inv_freq, self.batch, self.dtype = inv_freq, batch, dtype
        self.native_table: torch.Tensor | None = None

    def native(self, kernels, tokens: int) -> torch.Tensor:
        """The native kernels' [T, head_dim] cos | sin table, computed by the first layer that asks."""
        if self.native_table is None:
            seqs = self.batch.layout
            self.native_table = kernels.rope_table(seqs.q_start, seqs.q_lens, seqs.kv_lens, tokens, self.inv_freq)
        return self.native_table

    @functools.cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.batch.positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by position (the half-split layout HF Llama uses)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---------------------------------------------------------------------------- blocks

def linear_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias, scale) as the native kernels read a linear layer: a float weight packed (scale
    None), or a quantized linear's packed weight and its scales."""
    from engine.models.quant import QuantizedLinear

    if isinstance(module, QuantizedLinear):
        return module.packed, module.bias, module.scale
    if isinstance(module, NativeLinear):
        return module.native_weight, module.bias, None
    return module.weight, module.bias, None


def whole_blocks(module: nn.Module) -> bool:
    """Whether a linear's packed outputs are exactly its outputs (whole blocks of 16): what a layer's native
    call reads (a weight padded up to whole blocks runs module by module, its outputs cut)."""
    return module.out_features % 16 == 0


def stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the parts' outputs side by side: one matrix product (one read of
    the input, one kernel) instead of several."""
    weight = torch.cat([p.weight for p in parts])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                        device=weight.device, dtype=weight.dtype)
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        stacked.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return stacked


def stack_projections(model: nn.Module) -> None:
    """After loading: q/k/v of every attention block into one product, gate/up of every gated MLP into
    another (the checkpoint keeps them apart; the forward reads the stacked ones)."""
    for module in model.modules():
        if isinstance(module, (Attention, GatedMLP)):
            module.stack()


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up in one product once stacked."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None

    def stack(self) -> None:
        self.gate_up_proj = stacked_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:                       # as built (training tools): apart
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Grouped-query attention writing to and reading from layer `layer_id` of the paged cache.

    `input_size` is the width q/k/v read (hidden size, or 2x hidden for the EAGLE-3 midlayer);
    the output is always `hidden`."""

    def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int,
                 input_size: int | None = None, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        input_size = input_size or hidden
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.qkv_proj: nn.Linear | None = None
        self.qkv_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        # Qwen3: RMSNorm over each head's vector, before the rotary embedding.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def stack(self) -> None:
        self.qkv_proj = stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:                           # as built (training tools): apart
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def forward(self, x: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
        tokens = x.shape[0]
        if self.kernels is not None and self.qkv_proj is not None and self.native_fits(x, batch):
            return self.o_proj(self.native(self.qkv_proj(x), rope, batch))
        q, k, v = self.project(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope.tables
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, self.layer_id, batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def native_fits(self, x: torch.Tensor, batch: AttentionBatch) -> bool:
        """The native attention runs this forward: the cache holds x's dtype."""
        return batch.kv.k[self.layer_id].dtype == x.dtype

    def native(self, qkv: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
        """qk-norm, rotary, KV write and attention over the slot table in one native call: [T, H * D]."""
        seqs, kv = batch.layout, batch.kv
        norms = (None, None, 0.0)
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self.kernels.attention(qkv, self.num_heads, self.num_kv_heads, self.head_dim, kv.k[self.layer_id],
                                      kv.v[self.layer_id], seqs.q_start, seqs.q_lens, seqs.kv_lens, seqs.rows,
                                      seqs.table, rope.native(self.kernels, qkv.shape[0]), *norms, self.scale)
