"""`--quantization`: the decoder layers' linears and the LM head with fewer bytes a weight, for decoding
that reads every weight once a step (embedding rows are looked up, not multiplied, and stay in the model's
dtype; so do MoE experts).

- `int8`: weight-only int8, one float32 scale per output channel (symmetric, max |w| / 127); the
  activations stay float (the product widens each weight as it reads it and scales the sums).
- `w8a8_int8` (SGLang's name): the same weights against each row of activations quantized to int8 as it
  comes (one scale per row, max |x| / 127), the sums exact in int32.
- `int4`: weight-only 4-bit in groups of 32 inputs with one float16 scale per (output, group), as llama.cpp's
  q4_0 (the extreme of a group is level -8, the others round to nearest); the activations of a group are
  quantized to int8 with their own scale as the product reads them (llama.cpp's q8_0), the sums exact in
  int32 per group.

With the native CPU kernels every product runs on the packed weight at every row count (devices/native:
products.h has the layouts). Elsewhere (pure torch, CUDA/NPU) each class computes the same function in
torch (`reference`): correct, not fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8", "w8a8_int8", "int4")
BLOCK = 16                      # output channels of a packed block
EXACT_INPUTS = 1024             # int8 x int8 products a float32 sum holds exactly (w8a8_reference)
INT4_GROUP = 32                 # inputs sharing an int4 scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], float32 scale [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def pad_rows(q: torch.Tensor, multiple: int, value: int = 0) -> torch.Tensor:
    return F.pad(q, (0, 0, 0, -q.shape[0] % multiple), value=value)


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/16, K, 16] (N zero-padded): packed[nb][k][c] = q[16 nb + c][k]."""
    padded = pad_rows(q, BLOCK)
    return padded.view(-1, BLOCK, q.shape[1]).transpose(1, 2).contiguous()


def int8_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def w8a8_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/16, K/64, 16, 16, 4], N and K zero-padded to whole blocks:
    packed[nb][kb][p][c][e] = q[16 nb + c][64 kb + 4 p + e] (AMX tdpbssd's B operand, block by block)."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % 64, 0, -n % 16))
    n_pad, k_pad = padded.shape
    return padded.view(n_pad // 16, 16, k_pad // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def w8a8_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return packed.permute(0, 3, 1, 2, 4).reshape(packed.shape[0] * 16, packed.shape[1] * 64)[:n, :k]


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K'] in -8..7, float16 scale [N, K'/32]) with K' = K rounded up to 32 and
    weight ~= q * scale per group: llama.cpp's q4_0 rule (d = the group's extreme / -8, q = trunc(w / d + 8.5)
    - 8 capped at 7), the scale rounded to float16 first, as q4_0 stores it."""
    w = F.pad(weight.float(), (0, -weight.shape[1] % INT4_GROUP))
    groups = w.view(w.shape[0], -1, INT4_GROUP)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = (extreme / -8.0).to(torch.float16).float()
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(groups * inverse[..., None] + 8.5), 0, 15) - 8
    return q.to(torch.int8).view(w.shape), d.to(torch.float16)


def int4_pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K'] in -8..7, float16 [N, K'/32]) -> (uint8 [N/16, K'/32, 4, 64], float16 [N/16, K'/32, 16]),
    N padded: byte 4c + e of chunk j of group g holds q[16 nb + c][32 g + 8 j + e] + 8 in its low nibble and
    q[16 nb + c][32 g + 8 j + 4 + e] + 8 in its high one; the scales [nb][g][c]."""
    n, k = q.shape
    u = pad_rows(q.to(torch.int16) + 8, BLOCK, value=8).to(torch.uint8)
    blocks, groups = u.shape[0] // BLOCK, k // INT4_GROUP
    nibbles = u.view(blocks, BLOCK, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)     # [nb, g, j, half, c, e]
    packed = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).reshape(blocks, groups, 4, 64).contiguous()
    scales = pad_rows(scale, BLOCK).view(blocks, BLOCK, groups).transpose(1, 2).contiguous()
    return packed, scales


def int4_unpack(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4_pack's inverse: (int8 [N, K'] in -8..7, float16 [N, K'/32])."""
    blocks, groups = packed.shape[:2]
    both = torch.stack((packed & 15, packed >> 4), dim=3).view(blocks, groups, 4, 2, BLOCK, 4)
    q = both.permute(0, 4, 1, 2, 3, 5).reshape(blocks * BLOCK, groups * INT4_GROUP)[:n].to(torch.int8) - 8
    return q, scales.transpose(1, 2).reshape(blocks * BLOCK, groups)[:n]


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


def int4_reference(x: torch.Tensor, q_weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Int4Linear's function in torch: each row's groups of 32 quantized as quantize_rows quantizes a row,
    the exact int sums per group (at most 127 * 8 * 32: exact in float32), scaled by both scales and added
    over the groups (in torch's order: the kernel's agrees to float32 rounding)."""
    shape = x.shape
    rows = F.pad(x.reshape(-1, shape[-1]).float(), (0, q_weight.shape[1] - shape[-1]))
    groups = rows.view(rows.shape[0], -1, INT4_GROUP)
    q_x, x_scale = quantize_rows(groups.reshape(-1, INT4_GROUP))
    q_x, x_scale = q_x.float().view(groups.shape), x_scale.view(groups.shape[:2])
    w_groups = q_weight.float().view(q_weight.shape[0], -1, INT4_GROUP)
    sums = torch.einsum("mgi,ngi->mng", q_x, w_groups)
    y = (sums * (scale.float()[None, :, :] * x_scale[:, None, :])).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], -1)


class QuantizedLinear(nn.Module):
    """An nn.Linear's function with its weight quantized by `method` and packed as the native kernels
    read it (`packed`, `scale`); the kernels' `linear` runs it where the model has them, else `reference`."""

    method = ""
    kernels = None          # the native CPU kernels, when the model runs them (use_cpu_kernels)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed, scale = self.quantize_and_pack(weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> "QuantizedLinear":
        return cls(linear.weight.detach(), linear.bias)

    def quantize_and_pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_bias(self) -> torch.Tensor | None:
        """The bias as the kernels' product adds it (one value per packed output)."""
        return self.bias

    def packed_format(self) -> str | None:
        """Its quantization method where the native kernels run it, else None (the reference in torch)."""
        return self.method if self.kernels is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            y = self.kernels.linear(x, self.packed, self.kernel_bias(), self.scale)
            return y if y.shape[-1] == self.out_features else y[..., :self.out_features]   # int4: whole blocks
        return self.reference(x)


class Int8Linear(QuantizedLinear):
    """Weight-only int8: y = (x . q) * scale (+ bias), x as it is."""

    method = "int8"

    def quantize_and_pack(self, weight):
        q, scale = quantize_weight(weight)
        return int8_pack(q), scale

    def weight_int8(self) -> torch.Tensor:
        return int8_unpack(self.packed, self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_int8().to(torch.float32) * self.scale[:, None]).to(dtype)

    def reference(self, x):
        return F.linear(x, self.dequantized(x.dtype), self.bias)


class W8A8Linear(QuantizedLinear):
    """int8 weights against int8 activations: y = (q_x @ q_w^T) * scale_x[row] * scale_w (+ bias), the
    sums exact in int32. Each row is quantized alone, so a row's output does not depend on its batch. The
    weight is packed for AMX's int8 tile product (w8a8_pack), which the kernels also read with
    AVX512-VNNI, AVX2 or portable vectors, all with the same sums."""

    method = "w8a8_int8"

    def quantize_and_pack(self, weight):
        q, scale = quantize_weight(weight)
        return w8a8_pack(q), scale

    def weight_int8(self) -> torch.Tensor:
        return w8a8_unpack(self.packed, self.out_features, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_int8().to(torch.float32) * self.scale[:, None]).to(dtype)

    def reference(self, x):
        return w8a8_reference(x, self.weight_int8(), self.scale, self.bias)


class Int4Linear(QuantizedLinear):
    """4-bit weights in groups of 32 with float16 scales (llama.cpp's q4_0), each group of x quantized to
    int8 as the product reads it."""

    method = "int4"

    def quantize_and_pack(self, weight):
        return int4_pack(*quantize_int4(weight))

    def kernel_bias(self) -> torch.Tensor | None:
        """Padded with zeros to the packed outputs: int4's kernels give whole blocks of 16."""
        padded = self.packed.shape[0] * BLOCK
        if self.bias is None or padded == self.out_features:
            return self.bias
        return F.pad(self.bias, (0, padded - self.out_features))

    def weight_int4(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [N, K'] in -8..7, float16 [N, K'/32])."""
        return int4_unpack(self.packed, self.scale, self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        q, scale = self.weight_int4()
        w = q.float().view(q.shape[0], -1, INT4_GROUP) * scale.float()[..., None]
        return w.view(q.shape)[:, :self.in_features].to(dtype)

    def reference(self, x):
        q, scale = self.weight_int4()
        return int4_reference(x, q, scale, self.bias)


QUANTIZED_LINEAR = {"int8": Int8Linear, "w8a8_int8": W8A8Linear, "int4": Int4Linear}


def quantize(model: nn.Module, method: str | None) -> None:
    """The layers' nn.Linear modules quantized by `method` (None: left as they are). The LM head is
    quantized apart (quantize_lm_head): a draft head's is known only once bound to its target. Under
    w8a8_int8 the model's `mixed_scale_inputs` (linears whose input joins vectors of different scales) keep
    its dtype: one int8 scale a row would leave the smaller part a few levels (int4's scales are per group
    of 32 inputs, within one part)."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    kept = getattr(model, "mixed_scale_inputs", ()) if method == "w8a8_int8" else ()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head" and not (parent is model and name in kept):
                setattr(parent, name, QUANTIZED_LINEAR[method].of(child))


# The LM head's format under each method, where it differs: 4 bits there cost the most quality for the fewest
# bytes (one matrix of the model), so int4 keeps it at int8, as llama.cpp's q4_0 keeps its output tensor at
# a 6-bit format (docs/performance.md: perplexity).
LM_HEAD_METHOD = {"int4": "int8"}


def quantize_lm_head(model: nn.Module, method: str | None) -> None:
    """`lm_head_quantized` for project_to_vocab (engine/models/base.py); the float weight stays for the
    embedding lookup and for draft heads that share it."""
    if method is not None:
        method = LM_HEAD_METHOD.get(method, method)
        model.lm_head_quantized = QUANTIZED_LINEAR[method](model.lm_head_weight().detach(), None)
