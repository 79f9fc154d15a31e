"""--quantization int8, w8a8_int8 and int4 (engine/models/quant.py): the packed layouts, the native
products against torch's, and a model's logits against its unquantized self (tests/test_cpu_kernels.py
holds every format's product to its reference at every row count)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devices.cpu_native import cpu_kernels, describe_cpu_path
from engine.models.quant import (Int4Linear, Int8Linear, QuantizedLinear, W8A8Linear, int8_pack, int8_unpack,
                                 quantize_rows, quantize_weight, w8a8_pack, w8a8_reference, w8a8_unpack)
from tests.server_harness import DENSE

kernels = cpu_kernels("auto")


def test_quantized_weight_is_within_half_a_step_and_packs_both_ways():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 48, generator=gen) * torch.rand(100, 1, generator=gen) * 3
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()
    packed = int8_pack(q)
    assert packed.shape == (7, 48, 16)                          # 100 channels: seven blocks, 12 rows of padding
    assert torch.equal(int8_unpack(packed, 100), q)
    assert not packed[6, :, 4:].any()


@pytest.mark.skipif(kernels is None, reason="the native CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 65])
def test_native_product_matches_the_dequantized_one(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
        linear.bias.copy_(torch.randn(200, generator=gen))
    layer = Int8Linear.of(linear.to(dtype))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = F.linear(x.float(), layer.dequantized(torch.float32), layer.bias.float())
    layer.kernels = kernels
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    # against the float layer: int8 error only (a relative bound per output)
    exact = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_w8a8_weights_pack_both_ways_and_activations_quantize_row_by_row():
    gen = torch.Generator().manual_seed(0)
    q = quantize_weight(torch.randn(100, 72, generator=gen))[0]
    packed = w8a8_pack(q)
    assert packed.shape == (7, 2, 16, 16, 4) and packed.dtype == torch.int8      # N 100 -> 112, K 72 -> 128
    assert torch.equal(w8a8_unpack(packed, 100, 72), q)
    assert packed[:, 1, 2:].eq(0).all() and packed[6, :, :, 4:].eq(0).all()      # the padding is zeros
    x = torch.randn(3, 40, generator=gen) * torch.tensor([[0.01], [1.0], [100.0]])
    qx, scale = quantize_rows(x)
    assert qx.dtype == torch.int8 and qx.abs().amax(-1).eq(127).all()           # each row spans its own range
    assert ((qx.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 + 1e-6).all()
    assert quantize_rows(torch.zeros(1, 8))[0].eq(0).all()


def test_the_w8a8_reference_sums_exactly_past_what_one_float32_sum_holds():
    """5,003 products of 127 x 100..127 pass 2^24, where one float32 sum drifts by several units:
    the reference's chunked sums are the int64 ones, rounded once."""
    gen = torch.Generator().manual_seed(3)
    q_weight = torch.randint(100, 128, (4, 5003), generator=gen).to(torch.int8)
    x = torch.full((2, 5003), 127.0)                                       # scale 1: q_x = x
    want = torch.full((2, 5003), 127, dtype=torch.long) @ q_weight.long().T
    assert want.min() > 2 ** 24
    assert torch.equal(w8a8_reference(x, q_weight, torch.ones(4), None), want.float())


@pytest.mark.skipif(kernels is None, reason="the native CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("out_features, in_features, bias", [(512, 256, False), (200, 96, True)])
def test_the_w8a8_product_is_torch_s_and_no_row_depends_on_the_batch(dtype, rows, out_features, in_features, bias):
    """w8a8_linear against w8a8_reference bit for bit (exact int sums, then the same float32 operations
    and rounding); the tiles or AVX512-VNNI (where they run) and the plain loop give the same bits, and so does each
    row alone."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    layer = W8A8Linear(weight, torch.randn(out_features, generator=gen).to(dtype) if bias else None)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    want = w8a8_reference(x, layer.weight_int8(), layer.scale, layer.bias)
    layer.kernels = kernels
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert torch.equal(got, want)        # exact sums, then the reference's float32 operations and rounding
    before = kernels.set_tuning(isa_products=False)        # the portable sums: the same bits
    try:
        assert torch.equal(layer(x), got)
    finally:
        kernels.set_tuning(**before)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(rows)]), got)
    exact = F.linear(x.float(), weight, layer.bias.float() if bias else None)       # int8 error only
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_the_w8a8_product_refuses_a_weight_it_cannot_read():
    if kernels is None:
        pytest.skip("the native CPU kernels did not build here")
    layer = W8A8Linear(torch.randn(32, 64), None)
    with pytest.raises(RuntimeError, match="input width"):
        kernels.linear(torch.randn(2, 128), layer.packed, None, layer.scale)
    with pytest.raises(RuntimeError, match="a scale comes with a packed int8 or int4 weight"):
        kernels.linear(torch.randn(2, 64), layer.packed[:, :, :8], None, layer.scale)


@pytest.mark.parametrize("quantization", ["int8", "w8a8_int8", "int4"])
@pytest.mark.parametrize("cpu_kernels_choice", ["auto", "torch"])
def test_a_quantized_model_tracks_the_float_model(cpu_kernels_choice, quantization):
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits

    logits = {}
    kind = {"int8": Int8Linear, "w8a8_int8": W8A8Linear, "int4": Int4Linear}[quantization]
    for method in (None, quantization):
        model, _ = load_model(DENSE, torch.float32, "cpu", cpu_kernels_choice, method)
        if method:
            assert type(model.layers[0].mlp.down_proj) is kind
            head_kind = Int8Linear if quantization == "int4" else kind       # int4 keeps the LM head at int8
            assert type(model._modules.get("lm_head_quantized")) is head_kind
        runner = PagedRunner(model.kv_layout(), torch.float32, max_context=96)
        gen = torch.Generator().manual_seed(1)
        steps = [[(0, torch.randint(0, 4096, (40,), generator=gen).tolist()), (1, [7, 8, 9])]]
        steps += [[(0, [i + 3]), (1, [i + 5, i + 6])] for i in range(6)]
        logits[method] = step_logits(model, runner, steps)
    float_probs, quantized_probs = (F.softmax(logits[q], -1) for q in (None, quantization))
    kl = F.kl_div(quantized_probs.log(), float_probs, reduction="batchmean")
    assert kl < (0.1 if quantization == "int4" else 0.02), kl
    # random-token prompts give flat distributions, where 4 bits move the top token more often
    agree = (logits[None].argmax(-1) == logits[quantization].argmax(-1)).float().mean()
    assert agree >= (0.6 if quantization == "int4" else 0.9), agree


@pytest.mark.skipif(kernels is None, reason="the native CPU kernels did not build here")
@pytest.mark.parametrize("quantization", ["w8a8_int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_model_gives_the_same_logits_on_both_paths(dtype, quantization):
    """The native kernels (dense_layers reading the packed weights) and pure torch (each layer's reference)
    compute one function (tests/test_cpu_kernels.py holds the products themselves to their references)."""
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits

    logits = []
    for choice in ("native", "torch"):
        model, _ = load_model(DENSE, dtype, "cpu", choice, quantization)
        assert (model.native_stack is not None) == (choice == "native")
        described = describe_cpu_path(model)
        assert (f"{quantization} products on {kernels.product_path(quantization)}" in described) == (
            choice == "native")
        runner = PagedRunner(model.kv_layout(), dtype, max_context=96)
        steps = [[(0, list(range(3, 40))), (1, [7, 8, 9])]] + [[(0, [i + 3]), (1, [i + 5, i + 6])] for i in range(4)]
        logits.append(step_logits(model, runner, steps))
    # the paths' activations differ in the last bits (attention, norms), and where that crosses a rounding
    # boundary of quantize_rows an input moves by a whole int8 step: close, not equal, even in float32
    # (int4 quantizes each group of 32 inputs: more boundaries a row to cross)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= (0.9 if quantization == "int4" else 0.95)
    assert (logits[0] - logits[1]).abs().max() < 0.5


# integer sums in hardware (AMX int8 tiles, AVX512-VNNI, AVX2)
W8A8_FAST = kernels is not None and kernels.product_path("w8a8_int8") != "portable vectors"


@pytest.mark.parametrize("flags, expected", [
    ([], "w8a8_int8" if W8A8_FAST else "int8"),      # auto, native kernels: W8A8 drafts where its sums are fast,
    (["--dtype", "bfloat16"], "w8a8_int8" if W8A8_FAST else "int8"),                 # else int8
    (["--cpu-kernels", "torch"], None),                              # auto without them: as --quantization
    (["--cpu-kernels", "torch", "--quantization", "int8"], "int8"),
    (["--speculative-draft-quantization", "none"], None),
    (["--cpu-kernels", "torch", "--speculative-draft-quantization", "int8"], "int8"),
    (["--quantization", "w8a8_int8"], "w8a8_int8" if W8A8_FAST else "int8"),
    (["--cpu-kernels", "torch", "--quantization", "w8a8_int8"], "w8a8_int8"),
    (["--speculative-draft-quantization", "w8a8_int8"], "w8a8_int8"),
])
@pytest.mark.parametrize("algorithm", ["eagle", "standalone"])
def test_the_draft_model_is_quantized_as_the_flag_resolves(algorithm, flags, expected):
    """--speculative-draft-quantization: what the worker resolves is what its draft model holds."""
    if "--cpu-kernels" not in flags and cpu_kernels("auto") is None:
        pytest.skip("the native CPU kernels did not build here")
    from devices.cpu import CpuDevice
    from engine.args import parse_args
    from engine.rank import build_core
    device = CpuDevice()
    try:
        core = build_core(parse_args(["--model-path", str(DENSE), "--speculative-algorithm", algorithm, *flags]),
                          device, eos_ids=frozenset())
        worker = core.runner.decoding
        draft = worker.head if algorithm == "eagle" else worker.draft_model
        assert worker.draft_weights == expected
        kind = {"int8": Int8Linear, "w8a8_int8": W8A8Linear}.get(expected)
        assert {type(m) for m in draft.modules() if isinstance(m, QuantizedLinear)} == ({kind} if kind else set())
        assert type(getattr(draft, "lm_head_quantized", None)) is (kind or type(None))
        if algorithm == "eagle" and kind is not None:      # W8A8 keeps the fc of mixed scales in the head's dtype
            assert isinstance(draft.fc, QuantizedLinear) == (expected == "int8")
        target_int8 = any(isinstance(m, QuantizedLinear) for m in core.runner.model.modules())
        assert target_int8 == ("--quantization" in flags)         # the target keeps its own setting
    finally:
        device.close()
