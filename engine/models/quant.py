"""`--quantization int8`: weight-only int8 with one float32 scale per output channel (symmetric,
scale = max |w| / 127 over the channel's inputs), for the decoder layers' linears and the LM head.

On the CPU with the native kernels, a forward of a few rows (decode, verify, draft steps: where
reading the weights is the cost) multiplies by the int8 weights directly (devices/cpu_kernels.cpp:
int8_linear), reading a quarter of the bytes of float32; larger forwards (prompt chunks, where the
products are compute-bound) dequantize the weight to the activations' dtype for torch's product.
Elsewhere (no native kernels, CUDA/NPU) every forward dequantizes: correct, not fast.

Embedding rows are looked up, not multiplied, and stay in the model's dtype; so do MoE experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)
PACK = 64                       # output channels side by side in the packed layout (the kernel's PACK)
NATIVE_MAX_ROWS = 64            # above: the dequantized product is faster (64 rows 11.1 vs 15.9 ms, 96: 14.7 vs 12.2)


def int8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N / 64), K, 64]: blocks of 64 output channels, channel-minor (zero rows pad N)."""
    n, k = qweight.shape
    padded = F.pad(qweight, (0, 0, 0, -n % PACK))
    return padded.view(-1, PACK, k).transpose(1, 2).contiguous()


def int8_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scale [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """An nn.Linear's function with its weight as packed int8 + per-channel scales."""

    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", int8_pack(q))
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight.detach(), linear.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.int8_dequantize(self.packed, self.scale, dtype)
        w = int8_unpack(self.packed, self.out_features).to(torch.float32) * self.scale[:, None]
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernels is not None and rows <= NATIVE_MAX_ROWS:
            return self.kernels.int8_linear(x, self.packed, self.scale, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def quantize(model: nn.Module, method: str | None) -> None:
    """The layers' nn.Linear modules quantized by `method` (None: left as they are). The LM head is
    quantized apart (quantize_lm_head): a draft head's is known only once bound to its target."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, Int8Linear.of(child))


def quantize_lm_head(model: nn.Module, method: str | None) -> None:
    """`lm_head_int8` for project_to_vocab (engine/models/base.py); the float weight stays for the
    embedding lookup and for draft heads that share it."""
    if method is not None:
        model.lm_head_int8 = Int8Linear(model.lm_head_weight().detach(), None)
