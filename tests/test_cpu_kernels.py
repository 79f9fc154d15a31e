"""The native CPU kernels (devices/native/) against the pure-torch path they replace:
each kernel alone, attention over random slot tables (prompt chunks, decodes, verify runs,
GQA, qk-norm), the MoE experts (all held, and an expert-parallel share), the checks that refuse
bad layouts, the fallback when nothing builds, a whole model's logits on both paths, and the
stacked layers' call against the layers one by one."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from devices import cpu_native
from engine.models.attention import KVCache, build_attention_batch, chain_step_batch, paged_attention
from engine.models.layers import NativeLinear, RMSNorm, RotaryEmbedding, apply_rotary
from tests.server_harness import DENSE

kernels = cpu_native.cpu_kernels("auto")
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernels did not build here")


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_swiglu_match_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(7, 96, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x), **tolerance(dtype))
    h, normed = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    torch.testing.assert_close(h, x + delta)
    torch.testing.assert_close(normed, norm(x + delta), **tolerance(dtype))
    gate_up = (torch.randn(5, 2 * 50, generator=gen) * 8).to(dtype)        # large |gate|: exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, **tolerance(dtype))


FORMATS = ["float32", "bfloat16", "int8", "w8a8_int8", "int4"]


def packed_layer(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """(packed weight, scale, reference function) of a format, from a float32 weight."""
    from engine.models import quant
    if fmt in ("float32", "bfloat16"):
        w = weight.to(getattr(torch, fmt))
        return kernels.pack_float(w), None, lambda x: F.linear(x.double(), w.double(),
                                                               None if bias is None else bias.double())
    layer = quant.QUANTIZED_LINEAR[fmt](weight, None)
    return layer.packed, layer.scale, lambda x: (layer.reference(x.float()).double()
                                                 + (0 if bias is None else bias.double()))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 9, 16, 17, 40, 130])
@pytest.mark.parametrize("out_features,in_features", [(256, 768), (48, 96)])   # groups of 4 blocks, and 3
@pytest.mark.parametrize("bias", [False, True])
def test_each_format_s_product_matches_its_reference_and_no_row_depends_on_the_batch(fmt, rows, out_features,
                                                                                     in_features, bias):
    """Every packed format at every row count: its reference (torch's product of the same matrix, or the
    quantized function in torch) within the activations' rounding, and each row bit for bit what it is
    alone (a verify run reads what its decode steps would; prompts' many rows widen a group's weights once,
    a few rows widen them in registers: the same sums)."""
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed, scale, reference = packed_layer(fmt, weight, b, dtype)
    assert kernels.is_packed(packed, scale)
    y = kernels.linear(x, packed, b, scale)
    assert y.dtype == dtype and y.shape == (rows, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), reference(x), atol=1e-5, rtol=1e-5)
    else:       # the float32 sum of the same bf16 numbers, rounded to bf16 once: within one bf16 step
        torch.testing.assert_close(y.double(), reference(x), atol=1e-2, rtol=8e-3)
    alone = torch.cat([kernels.linear(x[i:i + 1], packed, b, scale) for i in range(rows)])
    assert torch.equal(y, alone)
    assert kernels.linear(x.view(1, rows, in_features), packed, b, scale).shape == (1, rows, out_features)


@pytest.mark.parametrize("fmt", ["int8", "w8a8_int8", "int4"])
def test_a_quantized_product_takes_bf16_rows_too(fmt):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=gen) / 10
    x = torch.randn(5, 96, generator=gen).bfloat16()
    packed, scale, reference = packed_layer(fmt, weight, None, torch.bfloat16)
    y = kernels.linear(x, packed, None, scale)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_isa_paths_and_the_portable_ones_agree(fmt):
    """The ISA-specific products this build has (AMX, AVX512-BF16, AVX512-VNNI, AVX2's integer ones)
    against the portable vectors on the same weights: the quantized formats' exact integer sums bit for bit;
    bf16 pairs multiplied in hardware within bf16 rounding of the widened float sums."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(80, 192, generator=gen) / 14
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    x = torch.randn(21, 192, generator=gen).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype)
    packed, scale, _ = packed_layer(fmt, weight, b, dtype)
    fast = kernels.linear(x, packed, b, scale)
    before = kernels.set_tuning(isa_products=False)
    try:
        assert "AVX" not in kernels.product_path(fmt) and "AMX" not in kernels.product_path(fmt)
        portable = kernels.linear(x, packed, b, scale)
    finally:
        kernels.set_tuning(**before)
    if fmt == "bfloat16":
        torch.testing.assert_close(fast.float(), portable.float(), atol=1e-2, rtol=8e-3)
    else:
        assert torch.equal(fast, portable)


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
@pytest.mark.parametrize("rows", [9, 16, 40, 80])
def test_weights_widened_once_or_run_by_run_give_the_same_sums(fmt, rows):
    """Past 8 rows (bf16) or 64 (int8) a pass may widen a group's weights to float32 once for every run, or
    each run may widen them as it reads (`widen_once`): the same values summed in the same order, so the
    same outputs."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 320, generator=gen) / 18
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    x = torch.randn(rows, 320, generator=gen).to(dtype)
    packed, scale, _ = packed_layer(fmt, weight, None, dtype)
    before = kernels.set_tuning(isa_products=False)            # bf16: the widened path, not the hardware's
    try:
        once = kernels.linear(x, packed, None, scale)
        kernels.set_tuning(widen_once=False)
        in_registers = kernels.linear(x, packed, None, scale)
    finally:
        kernels.set_tuning(**before)
    assert torch.equal(once, in_registers)
    assert torch.equal(in_registers[rows - 1:], kernels.linear(x[rows - 1:], packed, None, scale))


def test_the_build_s_features_decide_the_paths():
    """What runs where is what the build was compiled for (never what the test machine has)."""
    built = kernels.build_features()
    assert built["vector_bits"] in (128, 256, 512)
    assert (kernels.product_path("bfloat16") in ("AVX512-BF16", "AMX tiles")) == kernels.bf16_native()
    assert kernels.bf16_native() == (built["avx512_bf16"] or (built["amx_bf16"] and kernels.product_path(
        "bfloat16") == "AMX tiles"))
    assert (kernels.product_path("int4") == "AVX512-VNNI") == (built["avx512_vnni"] and built["avx512"])
    assert (kernels.product_path("int4") == "AVX2") == (built["avx2"] and not built["avx512_vnni"])
    assert kernels.product_path("float32") == f"portable {built['vector_bits']}-bit vectors"


def test_packing_round_trips_and_shapes_that_do_not_pack_stay_as_loaded():
    from engine.models import quant
    gen = torch.Generator().manual_seed(0)
    for dtype, shape in ((torch.float32, (3, 64, 16)), (torch.bfloat16, (3, 2, 16, 16, 2))):
        weight = torch.randn(48, 64, generator=gen).to(dtype)
        packed = kernels.pack_float(weight)
        assert packed.shape == shape and torch.equal(kernels.unpack_float(packed), weight)
    weight = torch.randn(48, 48, generator=gen).bfloat16()              # 48 bf16 inputs: not pairs of 32
    assert kernels.pack_float(weight).data_ptr() == weight.data_ptr()
    odd = torch.randn(40, 64, generator=gen)                             # 40 outputs: padded to 3 blocks
    packed = kernels.pack_float(odd)
    assert packed.shape == (3, 64, 16) and torch.equal(kernels.unpack_float(packed)[:40], odd)
    assert not kernels.unpack_float(packed)[40:].any()
    before = kernels.set_tuning(native_products=False)                 # loaded with the products off: nothing packs
    try:
        assert kernels.pack_float(torch.randn(48, 64, generator=gen)).dim() == 2
    finally:
        kernels.set_tuning(**before)
    q, scale = quant.quantize_int4(torch.randn(40, 70, generator=gen))
    assert q.shape == (40, 96) and scale.shape == (40, 3) and q.min() >= -8 and q.max() <= 7
    packed, scales = quant.int4_pack(q, scale)
    assert packed.shape == (3, 3, 4, 64) and scales.shape == (3, 3, 16)
    unpacked, unpacked_scale = quant.int4_unpack(packed, scales, 40)
    assert torch.equal(unpacked, q) and torch.equal(unpacked_scale, scale)
    q8 = quant.quantize_weight(torch.randn(40, 70, generator=gen))[0]
    assert torch.equal(quant.int8_unpack(quant.int8_pack(q8), 40), q8)


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_a_linear_of_outputs_not_in_whole_blocks_runs_natively_and_cuts_them(fmt):
    """An MoE router (8 experts) or an odd vocabulary: the weight packed with zero columns up to whole
    blocks, the module's outputs cut back to its own, each row the same alone as in a batch (torch's
    product would not keep that)."""
    from engine.models.layers import NativeLinear, use_cpu_kernels
    from engine.models.quant import QUANTIZED_LINEAR
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(64, 8, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(8, 64, generator=gen))
    holder = torch.nn.Sequential(linear if fmt is None else QUANTIZED_LINEAR[fmt].of(linear))
    use_cpu_kernels(holder, kernels)
    module = holder[0]
    assert fmt is not None or (type(module) is NativeLinear and kernels.is_packed(module.native_weight))
    x = torch.randn(11, 64, generator=gen)
    y = module(x)
    assert y.shape == (11, 8)
    want = F.linear(x, linear.weight, linear.bias) if fmt is None else module.reference(x)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cat([module(x[i:i + 1]) for i in range(11)]), y)


def test_int4_quantizes_as_llama_cpp_s_q4_0():
    """A group's extreme is level -8 (d = extreme / -8, the scale rounded to float16), the rest trunc(w / d
    + 8.5) - 8 capped at 7: q4_0's rule, so the two formats read the same numbers from the same weights."""
    from engine.models import quant
    group = torch.linspace(-1.0, 0.5, 32)
    q, scale = quant.quantize_int4(group[None, :])
    d = torch.tensor(-1.0 / -8).half().float()
    assert scale.item() == d.item() and q[0, 0] == -8
    want = torch.clamp(torch.trunc(group / d + 8.5), 0, 15) - 8
    assert torch.equal(q[0].float(), want)


def test_a_packed_weight_refuses_other_inputs():
    from engine.models import quant
    gen = torch.Generator().manual_seed(0)
    packed = kernels.pack_float(torch.randn(48, 64, generator=gen))
    with pytest.raises(RuntimeError, match="packed Float weight takes Float rows, not BFloat16"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="input width 32 != the weight's 64"):
        kernels.linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match=r"bias must be \[48\]"):
        kernels.linear(torch.randn(2, 64), packed, torch.zeros(47))
    layer = quant.Int4Linear(torch.randn(32, 64, generator=gen), None)
    with pytest.raises(RuntimeError, match="does not fit the weight's 64"):
        kernels.linear(torch.randn(2, 96), layer.packed, None, layer.scale)
    with pytest.raises(RuntimeError, match="a scale comes with a packed int8 or int4 weight"):
        kernels.linear(torch.randn(2, 64), torch.randn(32, 64), None, torch.ones(32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("held", [(0, 8), (2, 5)], ids=["all-experts", "expert-parallel-share"])
@pytest.mark.parametrize("hidden", [48, 64])         # 64: whole AMX tiles, the experts pack
def test_moe_experts_match_the_grouped_torch_path(dtype, tokens, held, hidden):
    from engine.models.moe import StackedExperts
    gen = torch.Generator().manual_seed(tokens)
    experts = StackedExperts(8, hidden, 32)
    experts.gate_up_proj.data = torch.randn(8, 64, hidden, generator=gen) / 7
    experts.down_proj.data = torch.randn(8, hidden, 32, generator=gen) / 6
    experts.keep(*held)
    experts = experts.to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, expert_ids = torch.topk(torch.rand(tokens, 8, generator=gen).softmax(-1), 2, dim=-1)
    reference = experts.forward_grouped(x, expert_ids, weights)
    native = kernels.moe_experts(x, expert_ids, weights, experts.gate_up_proj, experts.down_proj, experts.first)
    torch.testing.assert_close(native, reference, **tolerance(dtype))
    if dtype == torch.bfloat16 and hidden == 64:       # each expert packed (bf16: whole pairs of 32 inputs)
        gate_up, down = kernels.pack_float(experts.gate_up_proj), kernels.pack_float(experts.down_proj)
        count = held[1] - held[0]
        assert gate_up.shape == (count, 4, 2, 16, 16, 2) and down.shape == (count, 4, 1, 16, 16, 2)
        assert torch.equal(kernels.unpack_float(gate_up[1]), experts.gate_up_proj[1])
        tiled = kernels.moe_experts(x, expert_ids, weights, gate_up, down, experts.first)
        torch.testing.assert_close(tiled, reference, **tolerance(dtype))
    if dtype == torch.float32:        # each expert packed (48 outputs too)
        gate_up, down = kernels.pack_float(experts.gate_up_proj), kernels.pack_float(experts.down_proj)
        count = held[1] - held[0]
        assert gate_up.shape == (count, 4, hidden, 16) and down.shape == (count, hidden // 16, 32, 16)
        assert torch.equal(kernels.unpack_float(gate_up[1]), experts.gate_up_proj[1])
        packed = kernels.moe_experts(x, expert_ids, weights, gate_up, down, experts.first)
        torch.testing.assert_close(packed, reference, **tolerance(dtype))
    if held == (2, 5):             # rows routed to no held expert stay 0
        unrouted = ((expert_ids < 2) | (expert_ids >= 5)).all(dim=-1)
        assert torch.all(native[unrouted] == 0)


def torch_attention(qkv, heads, kv_heads, dim, kv, batch, inv_freq, q_norm=None):
    """The pure-torch path of Attention.forward after the projection."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim), v.reshape(tokens, kv_heads, dim)
    if q_norm is not None:
        q, k = q_norm(q), q_norm(k)
    freqs = batch.positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(qkv.dtype), angles.sin().to(qkv.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return paged_attention(q, k, v, 0, batch, dim ** -0.5).reshape(tokens, heads * dim)


def native_attention(qkv, heads, kv_heads, dim, kv, batch, inv_freq, q_norm=None):
    seqs = batch.layout
    rope = kernels.rope_table(seqs.q_start, seqs.q_lens, seqs.kv_lens, qkv.shape[0], inv_freq)
    norms = (q_norm.weight, q_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0)
    return kernels.attention(qkv, heads, kv_heads, dim, kv.k[0], kv.v[0], seqs.q_start, seqs.q_lens, seqs.kv_lens,
                             seqs.rows, seqs.table, rope, *norms, dim ** -0.5)


def random_cache(slots: int, kv_heads: int, dim: int, dtype, gen, page_size: int = 1) -> KVCache:
    kv = KVCache.allocate(1, slots, kv_heads, dim, dtype, page_size=page_size)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    return kv


def copy_of(kv: KVCache) -> KVCache:
    return KVCache(k=[kv.k[0].clone()], v=[kv.v[0].clone()], page_size=kv.page_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(4, 2, False), (6, 1, False), (4, 4, True)])
@pytest.mark.parametrize("dim", [16, 64, 128])      # 64, 128: few rows read in registers; 16: key by key
def test_attention_matches_the_torch_path(dtype, heads, kv_heads, qk_norm, dim):
    """A batch of a prompt chunk, decodes and verify-like runs over a shuffled slot table: the same
    outputs and the same keys and values written to the cache."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    page = 4
    q_lens, kv_lens, rows = [9, 1, 4, 1, 3], [9, 40, 23, 1, 61], [3, 0, 4, 2, 1]
    pages = torch.randperm(5 * 64 // page, generator=gen)             # KVPool's layout: whole pages, shuffled
    table = (pages[:, None] * page + torch.arange(page)).view(5, 64)
    kv = random_cache(5 * 64, kv_heads, dim, dtype, gen, page)
    batch = build_attention_batch(torch.tensor(q_lens), torch.tensor(kv_lens), torch.tensor(rows), table,
                                  max(q_lens), max(kv_lens), kv, tokens=sum(q_lens))
    qkv = torch.randn(sum(q_lens), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    inv_freq = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0}).inv_freq
    q_norm = None
    if qk_norm:
        q_norm = RMSNorm(dim, 1e-6).to(dtype)
        q_norm.weight.data = torch.rand(dim, generator=gen).to(dtype) + 0.5
    torch_kv, native_kv = copy_of(kv), copy_of(kv)
    want = torch_attention(qkv, heads, kv_heads, dim, torch_kv, batch.with_kv(torch_kv), inv_freq, q_norm)
    got = native_attention(qkv, heads, kv_heads, dim, native_kv, batch.with_kv(native_kv), inv_freq, q_norm)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    torch.testing.assert_close(native_kv.k[0], torch_kv.k[0], **tolerance(dtype))
    torch.testing.assert_close(native_kv.v[0], torch_kv.v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (6, 2), (2, 2)])
@pytest.mark.parametrize("run", [4, 8, 16])
def test_a_verify_run_attends_as_its_decode_steps_would(dtype, heads, kv_heads, run):
    """A run of `run` tokens over 37 cached positions gives, bit for bit, the outputs of `run`
    one-token steps: speculative verify runs keep plain greedy decoding's tokens (with 8 or more
    query rows a kv head the runs once attended by matrix products, whose sums differ). Odd
    groups (3, 1 query heads a kv head) pair query rows of two tokens, which see different keys."""
    gen = torch.Generator().manual_seed(run + heads)
    dim, cached = 64, 37
    kv = random_cache(128, kv_heads, dim, dtype, gen)
    table = torch.randperm(128, generator=gen)[None, :]
    qkv = torch.randn(run, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    inv_freq = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0}).inv_freq

    def attend(cache: KVCache, first: int, tokens: int) -> torch.Tensor:
        batch = build_attention_batch(torch.tensor([tokens]), torch.tensor([cached + first + tokens]),
                                      torch.tensor([0]), table, tokens, cached + run, cache, tokens=tokens)
        return native_attention(qkv[first:first + tokens], heads, kv_heads, dim, cache, batch, inv_freq)

    whole_kv, steps_kv = copy_of(kv), copy_of(kv)
    whole = attend(whole_kv, 0, run)
    steps = torch.cat([attend(steps_kv, i, 1) for i in range(run)])
    assert torch.equal(whole, steps)
    assert torch.equal(whole_kv.k[0], steps_kv.k[0]) and torch.equal(whole_kv.v[0], steps_kv.v[0])


def test_attention_reads_a_chain_steps_table_slice():
    """chain_step_batch's table is a column slice of the slot table (rows strided): read in place."""
    gen = torch.Generator().manual_seed(3)
    kv = random_cache(256, 2, 8, torch.float32, gen)
    table = torch.randperm(256, generator=gen)[:240].view(4, 60)
    rows, positions = torch.tensor([2, 0, 3]), torch.tensor([5, 31, 0])
    inv_freq = RotaryEmbedding(8, {"rope_type": "default", "rope_theta": 10000.0}).inv_freq
    qkv = torch.randn(3, 8 * 8, generator=gen)
    batch = chain_step_batch(positions, table[rows][:, :40], kv)
    assert not batch.layout.table.is_contiguous()
    torch_kv, native_kv = copy_of(kv), copy_of(kv)
    want = torch_attention(qkv, 4, 2, 8, torch_kv, batch.with_kv(torch_kv), inv_freq)
    got = native_attention(qkv, 4, 2, 8, native_kv, batch.with_kv(native_kv), inv_freq)
    torch.testing.assert_close(got, want)


def test_attention_refuses_bad_layouts_without_writing():
    gen = torch.Generator().manual_seed(4)
    kv = random_cache(32, 1, 8, torch.float32, gen)
    inv_freq = torch.ones(4)
    qkv = torch.randn(2, 3 * 8)
    rope = kernels.rope_table(torch.tensor([0]), torch.tensor([2]), torch.tensor([2]), 2, inv_freq)
    one = torch.tensor([0])

    def call(table, q_len=2, kv_len=2, row=0):
        return kernels.attention(qkv, 1, 1, 8, kv.k[0], kv.v[0], one, torch.tensor([q_len]), torch.tensor([kv_len]),
                                 torch.tensor([row]), table, rope, None, None, 0.0, 1.0)
    before = kv.k[0].clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(torch.tensor([[0, 99]]))
    with pytest.raises(RuntimeError, match="row 3 outside the table"):
        call(torch.tensor([[0, 1]]), row=3)
    with pytest.raises(RuntimeError, match="q_len 2, kv_len 9"):
        call(torch.tensor([[0, 1]]), kv_len=9)
    with pytest.raises(RuntimeError, match="must be float32"):
        kernels.attention(qkv, 1, 1, 8, kv.k[0], kv.v[0], one, torch.tensor([2]), torch.tensor([2]), one,
                          torch.tensor([[0, 1]]), rope.double(), None, None, 0.0, 1.0)
    assert torch.equal(kv.k[0][1:], before[1:])      # the checks run before anything is written past slot 0


def test_without_a_compiler_auto_falls_back_and_native_refuses(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_native.build.cache_clear()
    cpu_native.log_fallback.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="devices.cpu_native"):
            assert cpu_native.cpu_kernels("auto") is None
        assert "native CPU kernels unavailable" in caplog.text and "pure-torch path" in caplog.text
        with pytest.raises(cpu_native.NativeKernelsUnavailable, match="no C\\+\\+ compiler"):
            cpu_native.cpu_kernels("native")
        assert cpu_native.cpu_kernels("torch") is None
        with pytest.raises(ValueError, match="choose one of"):
            cpu_native.cpu_kernels("fast")
    finally:
        cpu_native.build.cache_clear()


def test_a_build_killed_midway_leaves_no_lock_that_stops_the_next(tmp_path):
    """torch's build lock is a plain file: a builder killed midway leaves it, and the next build would wait on
    it forever. The builder lock is the kernel's (freed with its holder): its holder removes a leftover, and
    a second builder waits for the first instead of removing the lock of a build in progress."""
    (tmp_path / "lock").touch()                              # what a killed build leaves
    with cpu_native.builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").touch()                          # this build's own lock, in progress
        entered = threading.Event()

        def second_builder():
            with cpu_native.builder_lock(tmp_path):
                entered.set()

        waiting = threading.Thread(target=second_builder)
        waiting.start()
        assert not entered.wait(0.3) and (tmp_path / "lock").exists()
        (tmp_path / "lock").unlink()                         # the first build finishes
    assert entered.wait(5)
    waiting.join(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tandem-dense", "tandem-moe"])
def test_a_model_gives_the_same_logits_on_both_paths(dtype, name):
    """Prompt chunks, then steps of decodes and multi-token (verify-like) runs side by side."""
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits

    logits = {}
    for choice in ("torch", "native"):
        model, _ = load_model(DENSE.parent / name, dtype, "cpu", cpu_kernels=choice)
        assert (model.layers[0].self_attn.kernels is None) == (choice == "torch")
        # every nn.Linear left (MoE attention, router) takes the native product; the log says which path runs
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all((type(m) is NativeLinear) == (choice == "native") for m in linears)
        described = cpu_native.describe_cpu_path(model)
        if choice == "torch":
            assert described.startswith("pure torch")
        else:
            fmt = str(dtype).removeprefix("torch.")
            assert f"built for {cpu_native.build_arch()}" in described
            assert f"{fmt} products on {kernels.product_path(fmt)}" in described
            assert any(kernels.is_packed(m.native_weight) for m in linears)
            assert ("each layer stack in one parallel region" in described) == (torch.get_num_threads() > 1)
        runner = PagedRunner(model.kv_layout(), dtype, max_context=128, page_size=4)
        gen = torch.Generator().manual_seed(0)
        steps = [[(0, torch.randint(0, 4096, (37,), generator=gen).tolist()), (1, [5, 6, 7, 8, 9])]]
        steps += [[(0, [i + 1]), (1, [i + 7, i + 8, i + 9]), (2, [3, 4] if i == 0 else [i])] for i in range(5)]
        logits[choice] = step_logits(model, runner, steps)
    if dtype == torch.float32:
        torch.testing.assert_close(logits["native"], logits["torch"], atol=1e-4, rtol=1e-4)
    else:       # bf16 rounds at different places on the two paths: the same tokens nearly everywhere
        same = (logits["native"].argmax(-1) == logits["torch"].argmax(-1)).float().mean()
        assert same >= 0.95 and (logits["native"] - logits["torch"]).abs().max() < 0.5


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_stacked_layers_call_equals_the_layers_one_by_one(quantization):
    """dense_layers runs the same dense_layer calls in order: the same logits, bit for bit."""
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits
    stacked = load_model(DENSE, torch.float32, "cpu", cpu_kernels="native", quantization=quantization)[0]
    one_by_one = load_model(DENSE, torch.float32, "cpu", cpu_kernels="native", quantization=quantization)[0]
    one_by_one.native_stack = None
    assert stacked.native_stack is not None
    steps = [[(0, list(range(3, 20))), (1, list(range(5, 9)))], [(0, [7]), (1, [9, 4, 2])]]
    with torch.inference_mode():
        logits = [step_logits(model, PagedRunner(model.kv_layout(), torch.float32, max_requests=2, max_context=64),
                              steps) for model in (stacked, one_by_one)]
    assert torch.equal(*logits)


TEAM_CASES = [("bfloat16", None), ("float32", None), ("bfloat16", "w8a8_int8"), ("float32", "int8"),
              ("float32", "int4")]


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    before = kernels.tuning()
    yield
    torch.set_num_threads(threads)
    kernels.set_tuning(**before)


@pytest.mark.parametrize("dtype,quantization", TEAM_CASES)
def test_a_stack_in_one_parallel_region_reads_what_a_region_per_loop_reads(dtype, quantization, two_threads):
    """dense_layers with every thread in one region for the whole stack (a team) gives the logits of the
    same kernels opening a region per loop, bit for bit, for prompts, decode steps and verify runs, with
    the row-wise steps of a few rows each thread's own or shared out; an EAGLE head's layer runs in a
    team too. Every format's products run in a team."""
    from engine.models.loader import load_draft, load_model
    from engine.models.testing import PagedRunner, step_logits
    model = load_model(DENSE, getattr(torch, dtype), "cpu", cpu_kernels="native", quantization=quantization)[0]
    steps = [[(0, list(range(3, 40))), (1, list(range(5, 9)))], [(0, [7]), (1, [9, 4, 2, 8, 1])],
             [(0, [3]), (1, [5]), (2, list(range(60, 80)))]]
    logits, ran = {}, {}
    for team, own_rows in ((True, True), (True, False), (False, True)):      # own rows: a few rows each thread's
        kernels.set_tuning(teams=team, own_rows=own_rows)
        before = kernels.team_stacks_run()
        runner = PagedRunner(model.kv_layout(), getattr(torch, dtype), max_requests=3, max_context=64)
        logits[team, own_rows] = step_logits(model, runner, steps)
        ran[team, own_rows] = kernels.team_stacks_run() - before
    kernels.set_tuning(own_rows=True)
    assert ran == {(True, True): len(steps), (True, False): len(steps), (False, True): 0}
    assert torch.equal(logits[True, True], logits[False, True])
    assert torch.equal(logits[True, False], logits[False, True])
    head = load_draft(f"{DENSE}-eagle", model, getattr(torch, dtype), "cpu", cpu_kernels="native",
                      quantization=quantization)[0]
    features = torch.randn(6, head.hidden_size, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    outs = {}
    for team in (True, False):
        kernels.set_tuning(teams=team)
        before = kernels.team_stacks_run()
        ids, batch = PagedRunner(head.kv_layout(), getattr(torch, dtype), max_requests=2, max_context=16).step(
            [(0, [4, 5, 6, 7]), (1, [8, 9])])
        with torch.inference_mode():
            outs[team] = head(ids, features, batch)
        ran[team] = kernels.team_stacks_run() - before
    assert ran[True] == 1 and ran[False] == 0
    assert torch.equal(outs[True], outs[False])


def test_a_team_s_failed_loop_raises_and_the_next_stack_runs(two_threads):
    """A slot outside the cache, found inside a loop of a team, raises once the region ends (no thread
    left waiting at a barrier); the next stack runs and reads what a region per loop reads."""
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner
    model = load_model(DENSE, torch.bfloat16, "cpu", cpu_kernels="native", quantization="w8a8_int8")[0]
    runner = PagedRunner(model.kv_layout(), torch.bfloat16, max_requests=2, max_context=32)
    ids, batch = runner.step([(0, [1, 2, 3, 4]), (1, [5, 6])])
    slot = int(runner.req_to_slot[1, 1])
    runner.req_to_slot[1, 1] = 10 ** 9
    before = kernels.team_stacks_run()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the cache"):
        model(ids, batch)
    assert kernels.team_stacks_run() == before + 1
    runner.req_to_slot[1, 1] = slot
    with torch.inference_mode():
        in_team = model(ids, batch).hidden
        kernels.set_tuning(teams=False)
        assert torch.equal(in_team, model(ids, batch).hidden)


def test_top_choice_is_torch_s_argmax_and_softmax_probability():
    """The draft step's choice (spec/chains.py: top_choice) natively: the first of equal maxima, the
    first NaN, and the top token's softmax probability, for float32 and bf16 logits."""
    from spec.chains import top_choice
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=gen) * 4
    logits[1, 7] = logits[1, 900] = 50.0                  # a tie: the first
    logits[2] = 0.0                                        # all equal: index 0, probability 1 / vocab
    logits[3, 11] = float("nan")                           # a NaN wins, as in torch's max
    logits[4, 4095] = 1e4                                  # one huge logit: probability 1
    logits[5] = -1e4                                       # all far below zero
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        top, confidence = top_choice(x, True, kernels)
        ref_top, ref_confidence = top_choice(x.float(), True)
        assert torch.equal(top, ref_top)
        ok = ~torch.isnan(ref_confidence)
        torch.testing.assert_close(confidence[ok], ref_confidence[ok], atol=1e-6, rtol=1e-5)
        assert torch.isnan(confidence[3]) and top[3] == 11
        assert top_choice(x, False, kernels)[1] is None
    with pytest.raises(RuntimeError, match="top_choice: logits must be"):
        kernels.top_choice(torch.zeros(3))


def draft_step_by_step(head, first, hidden, start, table, kv, steps, keep, threshold):
    """What the EAGLE worker's loop computes from Python: forward, compute_logits, top_choice and the
    keep rule at each step; the drafts, the rows kept and each step's confidences."""
    from spec.chains import top_choice
    drafts, kept, confidences, g = [first], [], [], hidden
    for i in range(1, steps + 1):
        g = head(drafts[-1], g, chain_step_batch(start + i - 1, table, kv))
        top, confidence = top_choice(head.compute_logits(g), True, head.kernels)
        confidences.append(confidence)
        keep = keep & ~(confidence < threshold)
        if not bool(keep.any()):
            break
        drafts.append(top)
        kept.append(keep)
    kept_rows = torch.stack(kept) if kept else torch.zeros(0, first.numel(), dtype=torch.bool)
    return torch.stack(drafts, 1), kept_rows, confidences


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int8", "w8a8_int8", "int4"])
@pytest.mark.parametrize("trim", ["none", "rows-drop", "early-end"])
def test_the_native_draft_chain_is_the_head_step_by_step(dtype, quantization, trim, two_threads):
    """eagle_chain (LlamaForCausalLMEagle.draft_chain) against the worker's loop from Python: the
    same drafts, the same rows kept, the chain ending at the same step, the same keys and values in
    the cache. The head reads a prompt of repeated tokens, so its drafts are confident. Where its
    products run in a team (every packed format), the whole chain runs in one parallel region."""
    from engine.models.loader import load_draft, load_model
    from engine.models.testing import PagedRunner
    target = load_model(DENSE, dtype, "cpu", cpu_kernels="native", quantization=quantization)[0]
    head = load_draft(DENSE.with_name("tandem-dense-eagle"), target, dtype, "cpu", cpu_kernels="native",
                      quantization=quantization)[0]
    lengths, steps = [40, 47, 61], 5
    prompts = [[(7 + 3 * b + i) % 11 + 100 for i in range(n)] for b, n in enumerate(lengths)]
    runners = [PagedRunner(head.kv_layout(), dtype, max_requests=3, max_context=96) for _ in range(3)]
    with torch.inference_mode():
        target_runner = PagedRunner(target.kv_layout(), dtype, max_requests=3, max_context=96)
        ids, batch = target_runner.step(list(enumerate(prompts)))
        features = target(ids, batch).hidden
        for runner in runners:
            ids, batch = runner.step(list(enumerate(prompts)))
            g = head(ids, features, batch)
        last = torch.tensor(lengths).cumsum(0) - 1
        hidden, first = g[last], head.compute_logits(g[last]).argmax(-1)
        start, keep, table = torch.tensor(lengths), torch.tensor([True, True, False]), runners[0].req_to_slot
        confidences = torch.stack(draft_step_by_step(head, first, hidden, start, table, runners[2].kv, steps, keep,
                                                     float("-inf"))[2])[:, :2]
        threshold = {"none": float("-inf"), "rows-drop": confidences.median().item(),
                     "early-end": confidences[0].max().item() + 1e-3}[trim]
        drafts, kept, _ = draft_step_by_step(head, first, hidden, start, table, runners[0].kv, steps, keep, threshold)
        before = kernels.team_chains_run()
        native_drafts, native_kept = head.draft_chain(first, hidden, start, table, runners[1].kv, steps, keep,
                                                      threshold)
    assert kernels.team_chains_run() - before == 1
    assert torch.equal(native_drafts, drafts) and torch.equal(native_kept, kept)
    assert {"none": kept.shape[0] == steps and torch.equal(kept[-1], keep),
            "rows-drop": kept.shape[0] >= 1 and not torch.equal(kept[-1], keep) or kept.shape[0] < steps,
            "early-end": kept.shape[0] == 0}[trim]
    assert torch.equal(runners[0].kv.k[0], runners[1].kv.k[0]) and torch.equal(runners[0].kv.v[0], runners[1].kv.v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int8", "w8a8_int8", "int4"])
def test_the_native_extend_is_the_heads_modules(dtype, quantization):
    """eagle_extend (LlamaForCausalLMEagle.extend_native) against what the EAGLE worker's extend runs
    from Python: the head over verify-like runs of 1, 3 and 5 tokens a row (after prompts of different
    lengths), each row's output at a picked position, its greedy draft and probability; the same
    numbers, and the same keys and values in the cache."""
    from engine.models.loader import load_draft, load_model
    from engine.models.testing import PagedRunner
    from spec.chains import top_choice
    target = load_model(DENSE, dtype, "cpu", cpu_kernels="native", quantization=quantization)[0]
    head = load_draft(DENSE.with_name("tandem-dense-eagle"), target, dtype, "cpu", cpu_kernels="native",
                      quantization=quantization)[0]
    lengths = [40, 47, 61]
    prompts = [[(7 + 3 * b + i) % 11 + 100 for i in range(n)] for b, n in enumerate(lengths)]
    verified = [[(5 * b + i) % 13 + 200 for i in range(q)] for b, q in enumerate([1, 3, 5])]
    pick = torch.tensor([0, 1 + 2, 1 + 3 + 4])             # row 0's only token, row 1's 3rd, row 2's 5th
    target_runner = PagedRunner(target.kv_layout(), dtype, max_requests=3, max_context=96)
    runners = [PagedRunner(head.kv_layout(), dtype, max_requests=3, max_context=96) for _ in range(2)]
    with torch.inference_mode():
        features = [target(*target_runner.step(list(enumerate(chunks)))).hidden for chunks in (prompts, verified)]
        for runner in runners:
            ids, batch = runner.step(list(enumerate(prompts)))
            head(ids, features[0], batch)
        ids, batch = runners[0].step(list(enumerate(verified)))
        g = head(ids, features[1], batch)[pick]
        top, confidence = top_choice(head.compute_logits(g), True, head.kernels)
        ids, batch = runners[1].step(list(enumerate(verified)))
        native_g, native_top, native_confidence = head.extend_native(ids, features[1], batch, pick)
    assert torch.equal(native_g, g) and torch.equal(native_top, top)
    assert torch.equal(native_confidence, confidence)
    assert torch.equal(runners[0].kv.k[0], runners[1].kv.k[0]) and torch.equal(runners[0].kv.v[0], runners[1].kv.v[0])


def test_a_head_the_kernels_cannot_run_whole_drafts_step_by_step():
    """A token map (draft ids are not target ids) or a cache of another dtype: no native chain, no
    native extend."""
    from engine.models.loader import load_draft, load_model
    from engine.models.testing import PagedRunner
    target = load_model(DENSE, torch.float32, "cpu", cpu_kernels="native")[0]
    head = load_draft(DENSE.with_name("tandem-dense-eagle"), target, torch.float32, "cpu", cpu_kernels="native")[0]
    one = torch.zeros(1, dtype=torch.long)
    args = (one, torch.zeros(1, head.hidden_size), one, torch.zeros(1, 8, dtype=torch.long))
    other_dtype = PagedRunner(head.kv_layout(), torch.bfloat16, max_requests=1, max_context=8).kv
    assert head.draft_chain(*args, other_dtype, 2, torch.ones(1, dtype=torch.bool), 0.1) is None
    head.restrict_vocab(torch.arange(0, head.vocab_size, 2))
    same_dtype = PagedRunner(head.kv_layout(), torch.float32, max_requests=1, max_context=8).kv
    assert head.draft_chain(*args, same_dtype, 2, torch.ones(1, dtype=torch.bool), 0.1) is None
    ids, batch = PagedRunner(head.kv_layout(), torch.float32, max_requests=1, max_context=8).step([(0, [1, 2])])
    assert head.extend_native(ids, torch.zeros(2, head.hidden_size), batch, one) is None


def test_switching_the_kernels_off_after_a_forward_leaves_nothing_native_cached(monkeypatch):
    """use_cpu_kernels(model, None) after native forwards: the next forward is the pure-torch one, not
    a stale stacked call or packed layer list from the kernels the model had."""
    from engine.models.layers import use_cpu_kernels
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits
    steps = [[(0, list(range(3, 20)))], [(0, [7])]]
    reference = load_model(DENSE, torch.float32, "cpu", cpu_kernels="torch")[0]
    model = load_model(DENSE, torch.float32, "cpu", cpu_kernels="native")[0]
    with torch.inference_mode():
        step_logits(model, PagedRunner(model.kv_layout(), torch.float32, max_context=64), steps)
        assert model.native_stack is not None and model.layers[0].native_weights is not None
        use_cpu_kernels(model, None)
        for name in ("dense_layers", "dense_layer", "linear", "rms_norm", "attention"):
            monkeypatch.setattr(kernels, name, lambda *a, **k: pytest.fail("a native kernel ran"), raising=False)
        logits = [step_logits(m, PagedRunner(m.kv_layout(), torch.float32, max_context=64), steps)
                  for m in (model, reference)]
    assert model.native_stack is None and model.layers[0].native_weights is None
    torch.testing.assert_close(*logits, atol=1e-5, rtol=1e-5)
