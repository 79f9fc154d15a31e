"""bench/make_model.py's checkpoints against Tandem's loader and transformers, and the pure-Python parts of the
baselines at a real model's size (bench/baseline_llamacpp.py's llama.cpp tools and vLLM server, against fakes:
neither runs here).

Run as a script, this file is a fake OpenAI-completions server that takes any server's flags (llama-server's,
vLLM's, run.py's) and answers on --port.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import baseline_llamacpp, baseline_vllm, make_model  # noqa: E402

TOL = 1e-4
LLAMA_CPP_ROOT = "llama.cpp"


def cli(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny target and its EAGLE head, written by the tool as a user runs it."""
    folder = tmp_path_factory.mktemp("models") / "llama-tiny"
    result = cli("bench/make_model.py", "tiny", "--layers", "3", "--eagle", "--out", str(folder))
    assert result.returncode == 0, result.stderr
    assert "made" in result.stdout
    return folder


# ---- bench/make_model.py --------------------------------------------------------------------

def test_named_sizes_have_their_parameter_counts():
    vocab = make_model.tokenizer_vocab()
    counts = {name: make_model.parameters(make_model.target_shapes(make_model.llama_config(shape, vocab, "float32")))
              for name, shape in make_model.SIZES.items()}
    assert 275e6 < counts["270m"] < 285e6 and 0.98e9 < counts["1b"] < 1.0e9
    config = make_model.llama_config(make_model.SIZES["1b"], vocab, "float32")
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (16, 2048, 8192)
    assert config["tie_word_embeddings"] is False and config["architectures"] == ["LlamaForCausalLM"]


def test_arguments_name_the_folder_and_refuse_a_bad_shape():
    args = make_model.parse_args(["270m", "--dtype", "bfloat16"])
    assert args.out == REPO / ".build" / "models" / "llama-270m-bf16"
    assert make_model.parse_args(["1b", "--layers", "2"]).out.name == "llama-1b-custom"
    assert make_model.parse_args(["tiny", "--hidden", "96"]).shape.hidden == 96
    bad = cli("bench/make_model.py", "tiny", "--heads", "6", "--kv-heads", "4")
    assert bad.returncode == 2 and "multiple of --kv-heads" in bad.stderr


def test_the_checkpoint_has_the_tokenizer_and_the_head_the_embedded_heads_layout(tiny):
    for name in ("config.json", "model.safetensors", *make_model.TOKENIZER_FILES):
        assert (tiny / name).is_file(), name
    from safetensors import safe_open

    def keys(folder: Path) -> set[str]:
        with safe_open(folder / "model.safetensors", "pt") as f:
            return set(f.keys())

    head = tiny.with_name(tiny.name + "-eagle")
    assert keys(head) == keys(REPO / "models" / "tandem-dense-eagle")
    embedded = json.loads((REPO / "models" / "tandem-dense-eagle" / "config.json").read_text())
    ours = json.loads((head / "config.json").read_text())
    assert set(ours) >= set(embedded) and ours["architectures"] == embedded["architectures"]
    assert ours["num_hidden_layers"] == 1 and ours["hidden_size"] == make_model.SIZES["tiny"].hidden


def test_tandem_loads_the_checkpoint_with_transformers_logits(tiny):
    """The torch path (cpu_kernels="torch"): this holds the checkpoint, the kernels have tests of their own."""
    import torch
    import transformers

    from engine.models.loader import load_draft, load_model
    from engine.models.testing import PagedRunner

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer("def fibonacci(n):\n    return", add_special_tokens=False).input_ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    model, _ = load_model(tiny, torch.float32, "cpu", cpu_kernels="torch")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        tokens, batch = PagedRunner(model.kv_layout(), torch.float32).step([(0, ids)])
        ours = model.compute_logits(model(tokens, batch).hidden)
    assert ours.shape == expected.shape == (len(ids), make_model.tokenizer_vocab())
    assert torch.isfinite(ours).all() and (ours - expected).abs().max() <= TOL
    head, _ = load_draft(tiny.with_name(tiny.name + "-eagle"), model, torch.float32, "cpu", cpu_kernels="torch")
    assert type(head).__name__ == "LlamaForCausalLMEagle" and head.hidden_size == model.hidden_size


def test_a_model_is_made_once_per_recipe_and_bfloat16_is_float32_rounded(tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "m"
    assert "made" in cli("bench/make_model.py", "tiny", "--out", str(folder)).stdout
    again = cli("bench/make_model.py", "tiny", "--out", str(folder))
    assert "already made" in again.stdout
    assert not folder.with_name("m.partial").exists()
    f32 = load_file(folder / "model.safetensors")
    out = cli("bench/make_model.py", "tiny", "--out", str(folder), "--dtype", "bfloat16").stdout
    assert "already made" not in out
    bf16 = load_file(folder / "model.safetensors")
    assert all(bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], f32[name].to(torch.bfloat16))
               for name in f32)
    weight = f32["model.layers.0.mlp.up_proj.weight"]
    assert abs(weight.std().item() - make_model.INIT_STD) < 0.002
    assert torch.equal(f32["model.norm.weight"], torch.ones_like(f32["model.norm.weight"]))
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- bench/baseline_llamacpp.py: llama.cpp's tools --------------------------------------------

FAKE_CONVERTER = """
import sys
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError
def main():
    assert TextModel().get_vocab_base_pre(None) == "gpt-2"          # the script answered it
    out = sys.argv[sys.argv.index("--outfile") + 1]
    open(out, "w").write(sys.argv[sys.argv.index("--outtype") + 1])
"""


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_server_script(record: Path, drop: int = 0) -> str:
    """A shell script that notes its arguments (and vLLM's environment) in `record`, then runs this file's
    fake server with them, the first `drop` left out."""
    return (f"#!/bin/sh\necho \"$@\" > {record}\n"
            f"echo \"$VLLM_CPU_KVCACHE_SPACE $VLLM_CPU_OMP_THREADS_BIND\" >> {record}\n"
            + (f"shift {drop}\n" if drop else "") + f"exec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")


def fake_llama_cpp(root: Path, quantize: bool = True) -> Path:
    """A llama.cpp folder: a converter that writes its --outtype, a llama-quantize that writes its type after its
    source's contents, and a llama-server that is this file's fake server."""
    executable(root / "convert_hf_to_gguf.py", FAKE_CONVERTER)
    executable(root / "build" / "bin" / "llama-server", fake_server_script(root / "server-args.txt"))
    if quantize:
        executable(root / "build" / "bin" / "llama-quantize",
                   f"#!/bin/sh\necho \"$@\" > {root}/quantize-args.txt\n(cat \"$1\"; echo \" $3\") > \"$2\"\n")
    return root


def fake_vllm_python(folder: Path, importable: bool = True) -> Path:
    """A Python that says it has vLLM (or fails to import it) and, given `-m MODULE ...`, runs the fake server."""
    check = "echo 0.32.0-fake; exit 0" if importable else "echo 'ImportError: torchvision' >&2; exit 1"
    script = fake_server_script(folder / "vllm-args.txt", drop=2)
    return executable(folder / "bin" / "python", script.replace("#!/bin/sh\n", f"#!/bin/sh\n"
                                                                 f"if [ \"$1\" = -c ]; then {check}; fi\n"))


def test_llama_cpp_tools_are_checked_with_a_clear_error(tmp_path):
    root = fake_llama_cpp(tmp_path / LLAMA_CPP_ROOT, quantize=False)
    tools = baseline_llamacpp.llama_paths(root, outtype="f32")
    assert tools.server.name == "llama-server" and tools.quantize is None
    with pytest.raises(SystemExit, match="needs build/bin/llama-quantize"):
        baseline_llamacpp.llama_paths(root, outtype="q4_0")
    with pytest.raises(SystemExit, match="needs build/bin/llama-server and convert_hf_to_gguf.py"):
        baseline_llamacpp.llama_paths(tmp_path / "nowhere", outtype="q8_0")


def test_q4_0_is_llama_quantize_of_the_f32_gguf_made_again_for_a_newer_model(tiny, tmp_path):
    root = fake_llama_cpp(tmp_path / LLAMA_CPP_ROOT)
    gguf = tmp_path / "gguf"
    args = baseline_llamacpp.parse_args(["--llama-cpp", str(root), "--model-path", str(tiny), "--outtype", "q4_0",
                                         "--gguf-dir", str(gguf), "--threads", "3"])
    tools = baseline_llamacpp.llama_paths(root, outtype="q4_0")
    out = baseline_llamacpp.gguf_for(args, tools)
    assert out == gguf / "llama-tiny-q4_0.gguf" and out.read_text().split() == ["f32", "Q4_0"]
    assert (root / "quantize-args.txt").read_text().split() == [str(gguf / "llama-tiny-f32.gguf"), str(out),
                                                               "Q4_0", "3"]
    (root / "quantize-args.txt").unlink()
    assert baseline_llamacpp.gguf_for(args, tools) == out and not (root / "quantize-args.txt").exists()
    later = out.stat().st_mtime + 10
    os.utime(tiny / "config.json", (later, later))
    baseline_llamacpp.gguf_for(args, tools)
    assert (root / "quantize-args.txt").exists()


def test_llama_server_runs_without_its_prompt_cache_and_tandem_gets_the_ggufs_dtype(tiny, tmp_path):
    args = baseline_llamacpp.parse_args(["--llama-cpp", str(tmp_path), "--model-path", str(tiny), "--outtype", "bf16",
                                         "--max-concurrency", "1,8", "--threads", "2", "--slot-context", "1024",
                                         "--config", "none=--speculative-algorithm none",
                                         "--config", "f32=--dtype float32"])
    command = baseline_llamacpp.llama_server_command(args, Path("llama-server"), Path("m.gguf"), 8080)
    assert command[:3] == ["llama-server", "-m", "m.gguf"]
    assert " ".join(command).endswith("--parallel 8 --threads 2 --ctx-size 8192 --no-webui --no-cache-prompt "
                                      "--cache-ram 0")
    assert args.config == [("none", ["--speculative-algorithm", "none", "--dtype", "bfloat16"]),
                           ("f32", ["--dtype", "float32"])]
    assert args.vllm_dtype == "bfloat16"
    quantized = baseline_llamacpp.parse_args(["--llama-cpp", str(tmp_path), "--model-path", str(tiny), "--outtype",
                                              "q8_0", "--server-args", "--quantization int8"])
    assert quantized.config == [("none", ["--speculative-algorithm", "none"])]
    assert baseline_llamacpp.with_dtype([], ["--dtype=float16"], "f32") == []


# ---- the vLLM baseline ---------------------------------------------------------------------

def test_vllm_runs_the_folder_without_prefix_caching_on_the_first_cpus(tiny):
    command = baseline_vllm.vllm_command("/venv/bin/python", tiny, "float32", 8000, "--max-num-seqs 16")
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(command)
    assert f"--model {tiny} --served-model-name llama-tiny --dtype float32" in text
    assert "--port 8000 --no-enable-prefix-caching --max-num-seqs 16" in text
    env = baseline_vllm.vllm_env(2, 3, base={"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["PATH"] == "/bin"
    assert baseline_vllm.cpu_list(5, {0, 1, 2, 5, 6, 9}) == "0-2,5-6"
    assert baseline_vllm.cpu_list(1, {3, 4}) == "3"


def test_a_missing_or_broken_vllm_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="is not an executable file"):
        baseline_vllm.check_vllm(str(tmp_path / "nowhere" / "python"))
    broken = fake_vllm_python(tmp_path / "broken", importable=False)
    with pytest.raises(SystemExit, match="torchvision, torchaudio and torchcodec") as error:
        baseline_vllm.check_vllm(str(broken))
    assert "ImportError: torchvision" in str(error.value)
    assert baseline_vllm.check_vllm(str(fake_vllm_python(tmp_path / "ok"))) == "0.32.0-fake"


def test_llama_server_vllm_and_tandem_side_by_side_in_one_run(tiny, tmp_path):
    root = fake_llama_cpp(tmp_path / LLAMA_CPP_ROOT)
    python = fake_vllm_python(tmp_path / "vllm-venv")
    out = tmp_path / "out.jsonl"
    result = cli("bench/baseline_llamacpp.py", "--llama-cpp", str(root), "--gguf-dir", str(tmp_path / "gguf"),
                 "--outtype", "q4_0", "--model-path", str(tiny), "--vllm-python", str(python), "--threads", "1",
                 "--server-script", __file__, "--config", "none=--speculative-algorithm none", "--rounds", "1",
                 "--max-concurrency", "1,2", "--dataset-name", "random", "--num-prompts", "3",
                 "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1",
                 "--output-file", str(out), "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.split("ratios are to 'llama.cpp-q4_0'")[1].splitlines()
    assert [line.split()[0] for line in lines[3:9]] == ["llama.cpp-q4_0", "vLLM-bfloat16", "none"] * 2
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["name"] for s in record["servers"]] == ["llama.cpp-q4_0", "vLLM-bfloat16", "none"]
    assert all(row["median"]["completed"] == 3 and row["runs"][0]["quiet_wait_s"] >= 0 for row in record["results"])
    assert record["vllm_dtype"] == "bfloat16" and record["model"] == str(tiny.resolve())
    served, env = (tmp_path / "vllm-venv" / "vllm-args.txt").read_text().splitlines()
    assert "--no-enable-prefix-caching" in served and "--dtype bfloat16" in served
    assert env == "1 " + baseline_vllm.cpu_list(1)
    assert "--no-cache-prompt" in (root / "server-args.txt").read_text()


# ---- run as a fake OpenAI-completions server ---------------------------------------------------

def fake_app():
    """Streams max_tokens tokens (" t0 t1 ...") on /v1/completions, with usage when asked."""
    from aiohttp import web

    async def completions(request: web.Request):
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                  for i in range(n)]
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt = len(body["prompt"].split())
            chunks.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                                    "total_tokens": prompt + n}})
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def health(_):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    from aiohttp import web

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    options, _ = parser.parse_known_args()
    web.run_app(fake_app(), host="127.0.0.1", port=options.port, print=None)
