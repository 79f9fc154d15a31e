"""bench/gpu_check.sh and its helpers, on the CPU: the random Llama maker on a tiny shape (transformers
and Tandem's loader both read it, every weight where Hugging Face puts it), the helper's argument
checks, the summary of a check from pytest's junit XML, compare.py's record and bench/dp_check.py's
result, the DP check's choice of backend (the device's own, else gloo, saying why) and its verdict,
a real DP check on the CPU (slow), and the script's refusal to run without a CUDA device."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench import dp_check, gpu_check
from tests.server_harness import REPO

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "96",
        "--context", "256"]


def test_the_random_llama_loads_in_transformers_and_in_tandem(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM
    from engine.models.loader import load_model
    assert gpu_check.main(["make-model", "--out", str(tmp_path), *TINY]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    vocab = json.loads((gpu_check.TOKENIZER / "config.json").read_text())["vocab_size"]
    assert config["vocab_size"] == vocab and len(AutoTokenizer.from_pretrained(tmp_path)) <= vocab
    reference = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)    # strict about names
    expected = 2 * vocab * 64 + 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 96 + 2 * 64)    # q, o; k, v; mlp; norms
    assert sum(p.numel() for p in reference.parameters()) == expected
    assert sum(math.prod(s) for s in gpu_check.weight_shapes(config).values()) == expected
    weights = dict(reference.named_parameters())
    assert weights["model.norm.weight"].eq(1).all()
    assert 0.01 < float(weights["model.layers.1.mlp.down_proj.weight"].detach().std()) < 0.03
    model, hf_config = load_model(tmp_path, torch.float32, "cpu")
    assert hf_config.num_hidden_layers == 2 and model.kv_layout() == (2, 2, 16)


@pytest.mark.parametrize("flags", [["--heads", "5"], ["--kv-heads", "3"], ["--layers", "0"]])
def test_the_maker_refuses_shapes_a_llama_cannot_have(flags, tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["make-model", "--out", str(tmp_path), *TINY, *flags])


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_cuda_graphs" name="test_a[cuda]"/>
<testcase classname="tests.test_cuda_graphs" name="test_b[cuda-eagle]"><failure message="x"/></testcase>
<testcase classname="tests.test_cuda_graphs" name="test_b[npu-eagle]"><skipped message="needs an NPU"/></testcase>
</testsuite></testsuites>"""


def compare_record(graphs_1: float, eager_1: float, graphs_16: float, eager_16: float) -> dict:
    def row(config, concurrency, tok_s):
        return {"config": config, "max_concurrency": concurrency, "runs": [],
                "median": {"output_throughput": tok_s, "mean_tpot_ms": 1000 / tok_s, "failed_total": 0}}
    return {"failed_servers": {}, "results": [row("graphs", 1, graphs_1), row("graphs", 16, graphs_16),
                                              row("eager", 1, eager_1), row("eager", 16, eager_16)]}


def test_the_summary_gathers_tests_and_speeds_with_graphs_over_eager(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "compare.jsonl").write_text(json.dumps(compare_record(1, 1, 1, 1)) + "\n"
                                            + json.dumps(compare_record(300.0, 100.0, 2000.0, 1600.0)) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 2048}))
    dp = {"device": "cuda", "backend": "gloo", "refused": {"nccl": "rank 1: DistBackendError: Duplicate GPU"},
          "equal_to_one_engine": True, "tokens": 80}
    (tmp_path / "dp_check.json").write_text(json.dumps(dp))
    out = tmp_path / "out" / "gpu_check.json"
    assert gpu_check.main(["summarize", "--out", str(out), "--junit", str(tmp_path / "junit.xml"), "--tests-rc", "1",
                           "--compare", str(tmp_path / "compare.jsonl"), "--bench-rc", "0", "--model", str(model),
                           "--dp", str(tmp_path / "dp_check.json"), "--dp-rc", "0", "--seconds", "312"]) == 0
    summary = json.loads(out.read_text())
    tests = summary["tests"]
    assert (tests["rc"], tests["passed"], tests["failed"], tests["skipped"], tests["errors"]) == (1, 1, 1, 1, 0)
    assert tests["failures"] == ["tests.test_cuda_graphs::test_b[cuda-eagle]"]
    bench = summary["benchmark"]
    assert bench["graphs_over_eager"] == {"1": pytest.approx(3.0), "16": pytest.approx(1.25)}   # the last record
    assert {(r["config"], r["max_concurrency"]) for r in bench["rows"]} == {("graphs", 1), ("graphs", 16),
                                                                          ("eager", 1), ("eager", 16)}
    assert bench["model"] == {"hidden_size": 2048} and summary["seconds"] == 312
    assert "python" in summary["environment"]
    assert summary["dp_attention"] == {"rc": 0, **dp}


def test_a_summary_of_a_check_that_never_got_far_says_so(tmp_path):
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["summarize", "--out", str(out), "--junit", str(tmp_path / "absent.xml"),
                    "--compare", str(tmp_path / "absent.jsonl")])
    summary = json.loads(out.read_text())
    assert "note" in summary["tests"] and "note" in summary["benchmark"] and summary["benchmark"]["rows"] == []
    assert "note" in summary["dp_attention"] and summary["dp_attention"]["rc"] is None


def test_the_dp_check_tries_the_devices_own_backend_first_then_gloo():
    assert dp_check.backends("cuda", "auto") == ["nccl", "gloo"]
    assert dp_check.backends("npu", "auto") == ["hccl", "gloo"]
    assert dp_check.backends("cpu", "auto") == ["gloo"]
    assert dp_check.backends("cuda", "gloo") == ["gloo"]


REFERENCE = {"r0": [5, 6, 7], "r1": [8, 9]}


@pytest.mark.parametrize("gloo_gives, equal, rc", [(REFERENCE, True, 0), ({"r0": [5, 6, 7], "r1": [8, 1]}, False, 1)])
def test_the_dp_check_falls_back_to_gloo_says_why_and_compares_with_one_engine(gloo_gives, equal, rc, tmp_path,
                                                                              monkeypatch, capsys):
    tried = []

    def run_group(backend, device_name, timeout):
        tried.append(backend)
        return (None, "rank 1: DistBackendError: Duplicate GPU detected") if backend == "nccl" else (gloo_gives, None)
    monkeypatch.setattr(dp_check, "one_engine", lambda device_name: REFERENCE)
    monkeypatch.setattr(dp_check, "run_group", run_group)
    out = tmp_path / "dp.json"
    assert dp_check.main(["--device", "cuda", "--out", str(out)]) == rc
    result = json.loads(out.read_text())
    assert tried == ["nccl", "gloo"] and result["backend"] == "gloo" and result["tokens"] == 5
    assert result["refused"] == {"nccl": "rank 1: DistBackendError: Duplicate GPU detected"}
    assert result["equal_to_one_engine"] is equal and result["differing"] == ([] if equal else ["r1"])
    line = capsys.readouterr().out
    assert "over gloo (nccl refused: rank 1: DistBackendError: Duplicate GPU detected)" in line
    assert ("equal to one engine" in line) is equal


def test_the_dp_check_says_when_no_backend_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(dp_check, "one_engine", lambda device_name: REFERENCE)
    monkeypatch.setattr(dp_check, "run_group", lambda *args: (None, "no answer from every rank in 45 s"))
    assert dp_check.main(["--device", "cuda", "--out", str(tmp_path / "dp.json")]) == 1
    result = json.loads((tmp_path / "dp.json").read_text())
    assert result["backend"] is None and set(result["refused"]) == {"nccl", "gloo"}


@pytest.mark.slow
def test_the_dp_check_runs_two_ranks_in_two_processes_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "dp_check.py"), "--device", "cpu", "--out",
                           str(tmp_path / "dp.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "dp.json").read_text())
    assert result["backend"] == "gloo" and result["equal_to_one_engine"] and result["refused"] == {}
    assert result["requests"] == len(dp_check.PROMPTS) and result["tokens"] == sum(6 + 5 * i for i in range(5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_script_refuses_to_run_without_a_cuda_device(tmp_path):
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []
