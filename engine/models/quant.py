"""`--quantization int8`: weight-only int8 with one float32 scale per output channel (symmetric,
scale = max |w| / 127 over the channel's inputs), for the decoder layers' linears and the LM head.
`--quantization w8a8_int8` (SGLang's name): the same weights, multiplied by each row of activations
quantized to int8 as it comes (one scale per row, max |x| / 127); see W8A8Linear.

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

QUANTIZATIONS = ("int8", "w8a8_int8")
PACK = 64                       # output channels side by side in the packed layout (the kernel's PACK)
EXACT_INPUTS = 1024             # int8 x int8 products a float32 sum holds exactly (w8a8_reference)
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

    @staticmethod
    def pack(q: torch.Tensor) -> torch.Tensor:
        """The int8 weight [N, K] as this layer's product reads it."""
        return int8_pack(q)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", self.pack(q))
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


class W8A8Linear(Int8Linear):
    """int8 weights against int8 activations: y = (q_x @ q_w^T) * scale_x[row] * scale_w (+ bias), the
    sums exact in int32. Each row is quantized alone (quantize_rows), so a row's output does not
    depend on its batch. The weight is packed for AMX's int8 tile product (w8a8_pack); the native
    kernels run it at every row count, on tiles where the CPU grants them, else with AVX512-VNNI's
    vpdpbusd where the CPU has it, else a plain loop, all with the same sums (devices/cpu_kernels.cpp:
    w8a8_linear). Without them (pure torch, CUDA, NPU) torch computes the same function (w8a8_reference)."""

    @staticmethod
    def pack(q: torch.Tensor) -> torch.Tensor:
        return w8a8_pack(q)

    def weight_int8(self) -> torch.Tensor:
        return w8a8_unpack(self.packed, self.out_features, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_int8().to(torch.float32) * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.w8a8_linear(x, self.packed, self.scale, self.bias)
        return w8a8_reference(x, self.weight_int8(), self.scale, self.bias)


def w8a8_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/16, K/64, 16, 16, 4], N and K zero-padded to whole blocks:
    packed[nb][kb][p][c][e] = q[16 nb + c][64 kb + 4 p + e] (AMX tdpbssd's B operand, block by block)."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % 64, 0, -n % 16))
    n_pad, k_pad = padded.shape
    return padded.view(n_pad // 16, 16, k_pad // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def w8a8_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return packed.permute(0, 3, 1, 2, 4).reshape(packed.shape[0] * 16, packed.shape[1] * 64)[:n, :k]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] as int8 with its float32 scale: top / 127 for top = max |x|, the values
    multiplied by 127 / top (the kernel's float32 quotient; torch's `127.0 / top` is 127 times the
    reciprocal, a different float) and rounded half to even."""
    x = x.float()
    top = x.abs().amax(dim=-1).clamp(min=1e-12)
    inv = torch.full_like(top, 127.0) / top
    return torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8), top / 127.0


def w8a8_reference(x: torch.Tensor, q_weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8Linear's function in torch, scaled as the kernel does. The int sums run as float32 products
    of EXACT_INPUTS inputs at a time (127 * 127 * 1024 < 2^24: exact) added in int32, so they are
    exact on any device (no float64, which not every accelerator multiplies)."""
    shape = x.shape
    q_x, x_scale = quantize_rows(x.reshape(-1, shape[-1]))
    q_x, q_w = q_x.float(), q_weight.float()
    sums = sum((q_x[:, k:k + EXACT_INPUTS] @ q_w[:, k:k + EXACT_INPUTS].T).to(torch.int32)
               for k in range(0, q_x.shape[1], EXACT_INPUTS)).float()
    y = sums * x_scale[:, None] * scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], -1)


QUANTIZED_LINEAR = {"int8": Int8Linear, "w8a8_int8": W8A8Linear}


def quantize(model: nn.Module, method: str | None) -> None:
    """The layers' nn.Linear modules quantized by `method` (None: left as they are). The LM head is
    quantized apart (quantize_lm_head): a draft head's is known only once bound to its target. Under
    w8a8_int8 the model's `mixed_scale_inputs` (linears whose input joins vectors of different
    scales) keep its dtype: one int8 scale a row would leave the smaller part a few levels."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    kept = getattr(model, "mixed_scale_inputs", ()) if method == "w8a8_int8" else ()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head" and not (parent is model and name in kept):
                setattr(parent, name, QUANTIZED_LINEAR[method].of(child))


def quantize_lm_head(model: nn.Module, method: str | None) -> None:
    """`lm_head_int8` for project_to_vocab (engine/models/base.py); the float weight stays for the
    embedding lookup and for draft heads that share it."""
    if method is not None:
        model.lm_head_int8 = QUANTIZED_LINEAR[method](model.lm_head_weight().detach(), None)
