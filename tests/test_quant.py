"""--quantization int8 (engine/models/quant.py): the packed layout, the native product against the
dequantized one, and a model's logits against its unquantized self."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devices.cpu_native import cpu_kernels
from engine.models.quant import NATIVE_MAX_ROWS, Int8Linear, int8_pack, int8_unpack, quantize_weight
from tests.server_harness import DENSE

kernels = cpu_kernels("auto")


def test_quantized_weight_is_within_half_a_step_and_packs_both_ways():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 48, generator=gen) * torch.rand(100, 1, generator=gen) * 3
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()
    packed = int8_pack(q)
    assert packed.shape == (2, 48, 64)                          # 100 channels: two blocks, 28 rows of padding
    assert torch.equal(int8_unpack(packed, 100), q)
    assert not packed[1, :, 36:].any()


@pytest.mark.skipif(kernels is None, reason="the native CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1])
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


@pytest.mark.parametrize("cpu_kernels_choice", ["auto", "torch"])
def test_int8_model_tracks_the_float_model(cpu_kernels_choice):
    from engine.models.loader import load_model
    from engine.models.testing import PagedRunner, step_logits

    logits = {}
    for quantization in (None, "int8"):
        model, _ = load_model(DENSE, torch.float32, "cpu", cpu_kernels_choice, quantization)
        if quantization:
            assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
            assert isinstance(model._modules.get("lm_head_int8"), Int8Linear)
        runner = PagedRunner(model.kv_layout(), torch.float32, max_context=96)
        gen = torch.Generator().manual_seed(1)
        steps = [[(0, torch.randint(0, 4096, (40,), generator=gen).tolist()), (1, [7, 8, 9])]]
        steps += [[(0, [i + 3]), (1, [i + 5, i + 6])] for i in range(6)]
        logits[quantization] = step_logits(model, runner, steps)
    float_probs, int8_probs = (F.softmax(logits[q], -1) for q in (None, "int8"))
    kl = F.kl_div(int8_probs.log(), float_probs, reduction="batchmean")
    assert kl < 0.02, kl
    assert (logits[None].argmax(-1) == logits["int8"].argmax(-1)).float().mean() >= 0.9


TILES = kernels is not None and kernels.tile_products_run()      # --dtype auto is bf16 on such a CPU


@pytest.mark.parametrize("flags, expected", [
    ([], "int8"),                                     # auto (float32 in the tests), native kernels: int8 drafts
    (["--dtype", "bfloat16"], None if TILES else "int8"),          # bf16 products on AMX tiles: a bf16 head
    (["--cpu-kernels", "torch"], None),                              # auto without them: as --quantization
    (["--cpu-kernels", "torch", "--quantization", "int8"], "int8"),
    (["--speculative-draft-quantization", "none"], None),
    (["--cpu-kernels", "torch", "--speculative-draft-quantization", "int8"], "int8"),
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
        worker = core.runner.worker
        draft = worker.head if algorithm == "eagle" else worker.draft_model
        assert worker.draft_weights == expected
        assert any(isinstance(m, Int8Linear) for m in draft.modules()) == (expected == "int8")
        assert (getattr(draft, "lm_head_int8", None) is not None) == (expected == "int8")
        target_int8 = any(isinstance(m, Int8Linear) for m in core.runner.model.modules())
        assert target_int8 == ("--quantization" in flags)         # the target keeps its own setting
    finally:
        device.close()
