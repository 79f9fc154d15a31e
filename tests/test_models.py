"""Tandem's model code against transformers (targets) and plain-torch references (EAGLE heads).

Every comparison runs Tandem's model over the paged KV cache with shuffled slots, through
prefill, step-by-step decode and mixed batches, and checks each produced row against the
reference's logits at the same position of the full sequence.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.loader import CheckpointError, load_draft, load_model
from engine.models.testing import PagedRunner

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-4
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

TINY_CONFIGS = {
    # tied embeddings + llama3 rope scaling (wavelengths straddle the smoothing band)
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_hidden_layers=3, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False),
    "qwen3_moe_step2": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_hidden_layers=2, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=False),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}

# Steps of (sequence index, tokens to feed); every sequence is fed in order from its start.
PREFILL = [[(0, 7), (1, 3), (2, 12), (3, 1)]]
DECODE = [[(0, 4), (1, 1), (2, 6)]] + [[(0, 1), (1, 1), (2, 1)]] * 5
MIXED = [[(0, 5), (1, 3)],
         [(0, 1), (2, 4), (1, 1)],           # sequence 2 prefills a chunk while 0 and 1 decode
         [(2, 3), (0, 1), (1, 1)],
         [(1, 1), (2, 1), (0, 1), (3, 6)]]
ROWS = [5, 2, 7, 0]                          # request-table row of sequence i


def random_sequences(lengths: list[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def sequence_lengths(schedule) -> list[int]:
    lengths: dict[int, int] = {}
    for step in schedule:
        for seq, count in step:
            lengths[seq] = lengths.get(seq, 0) + count
    return [lengths[i] for i in sorted(lengths)]


def run_schedule(forward, kv_layout, schedule, sequences, page_size: int = 1):
    """Feed `sequences` to `forward(ids, batch, seq_and_positions)` step by step over a paged
    cache; returns per sequence the output rows in position order."""
    runner = PagedRunner(kv_layout, torch.float32, max_requests=8, max_context=64, seed=1, page_size=page_size)
    fed = [0] * len(sequences)
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        chunks, spans = [], []
        for seq, count in step:
            chunks.append((ROWS[seq], sequences[seq][fed[seq]:fed[seq] + count]))
            spans.append((seq, range(fed[seq], fed[seq] + count)))
            fed[seq] += count
        ids, batch = runner.step(chunks)
        rows = forward(ids, batch, spans)
        for (seq, _positions), out in zip(spans, rows.split([len(p) for _, p in spans])):
            outputs[seq].extend(out)
    return [torch.stack(rows) for rows in outputs]


def max_diff(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b[:len(a)]).abs().max().item() for a, b in zip(ours, reference))


# ---------------------------------------------------------------------------- tiny HF targets

def random_hf_model(name: str):
    """A tiny HF model with weights large enough that routing and logits are far from ties."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[name]()).float().eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.08) if param.dim() > 1 else param.normal_(1.0, 0.1)
    return hf_model


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_target(request, tmp_path_factory):
    """(Tandem model, HF model, checkpoint folder) for one tiny random architecture."""
    hf_model = random_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    model, _ = load_model(folder, torch.float32, "cpu")
    return model, hf_model, folder


@torch.no_grad()
def hf_logits(hf_model, sequences):
    return [hf_model(torch.tensor([seq])).logits[0].float() for seq in sequences]


@torch.no_grad()
def tandem_logits(model, schedule, sequences, page_size: int = 1):
    forward = lambda ids, batch, spans: model.compute_logits(model(ids, batch).hidden)  # noqa: E731
    return run_schedule(forward, model.kv_layout(), schedule, sequences, page_size)


@pytest.mark.parametrize("page_size", [1, 4], ids=["slots", "pages-of-4"])
@pytest.mark.parametrize("schedule", [PREFILL, DECODE, MIXED], ids=["prefill", "decode", "mixed"])
def test_target_matches_transformers(tiny_target, schedule, page_size):
    """page_size 4: keys are gathered a page at a time (shuffled pages, sequences ending mid-page)."""
    model, hf_model, _ = tiny_target
    sequences = random_sequences(sequence_lengths(schedule), seed=3)
    ours = tandem_logits(model, schedule, sequences, page_size)
    assert all(o.dtype == torch.float32 for o in ours)
    assert max_diff(ours, hf_logits(hf_model, sequences)) <= TOL


def test_sharded_checkpoint_loads_identically(tiny_target, tmp_path):
    model, hf_model, _ = tiny_target
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, _ = load_model(tmp_path, torch.float32, "cpu")
    expected = model.state_dict()
    assert sharded.state_dict().keys() == expected.keys()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@torch.no_grad()
def test_aux_hidden_is_the_stream_entering_each_layer(tiny_target):
    model, hf_model, _ = tiny_target
    layers = [1, model.num_layers - 1]       # HF's hidden_states[i] is the input of layer i (i < num_layers)
    model.set_aux_capture_layers(layers)
    sequences = random_sequences([6, 2], seed=4)
    captured = run_schedule(lambda ids, batch, spans: model(ids, batch, capture_aux=True).aux_hidden,
                            model.kv_layout(), [[(0, 4), (1, 2)], [(0, 2)]], sequences)
    model.set_aux_capture_layers([])
    for seq, aux in zip(sequences, captured):
        states = hf_model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        assert (aux - torch.cat([states[i][0] for i in layers], -1)).abs().max() <= TOL


def test_bfloat16_load_runs(tiny_target):
    _, _, folder = tiny_target
    model, _ = load_model(folder, "bfloat16", "cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ids, batch = PagedRunner(model.kv_layout(), torch.bfloat16).step([(0, [1, 2, 3])])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, batch).hidden)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


COMPILER_MODULES = ("torch._dynamo", "sympy")
LOAD_AND_RUN = """
import sys, torch
from engine.models.loader import load_draft, load_model
from engine.models.testing import PagedRunner
for target, head in (("tandem-dense", "tandem-dense-eagle"), ("tandem-moe", "tandem-moe-eagle")):
    model, _ = load_model("models/" + target, "bfloat16", "cpu")
    load_draft("models/" + head, model, "bfloat16", "cpu")
    ids, batch = PagedRunner(model.kv_layout(), torch.bfloat16).step([(0, [1, 2, 3])])
    with torch.inference_mode():
        model.compute_logits(model(ids, batch).hidden)
print(sorted(name for name in %r if name in sys.modules))
"""


def test_loading_and_running_import_no_compiler_stack():
    """Building a model on the meta device skips nn.init's fills (loader.InitSkipped): on meta they
    import torch._dynamo and sympy, about 80 MB of every rank's resident memory, for values the
    checkpoint then replaces. A fresh interpreter, as a rank starts."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", LOAD_AND_RUN % (COMPILER_MODULES,)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------- loader errors

@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    hf_model = random_hf_model("qwen3_moe")
    folder = tmp_path_factory.mktemp("errors")
    hf_model.save_pretrained(folder)
    return folder


def edited_copy(source: Path, dest: Path, edit) -> Path:
    """A copy of a single-file checkpoint whose tensors dict went through `edit`."""
    dest.mkdir(exist_ok=True)
    (dest / "config.json").write_text((source / "config.json").read_text())
    with safe_open(source / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, dest / "model.safetensors")
    return dest


def test_missing_tensor_is_named(moe_folder, tmp_path):
    folder = edited_copy(moe_folder, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(folder)


def test_missing_expert_is_named(moe_folder, tmp_path):
    folder = edited_copy(moe_folder, tmp_path / "m", lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(folder)


def test_unexpected_tensor_is_named(moe_folder, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    folder = edited_copy(moe_folder, tmp_path / "u", add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_model(folder)


def test_misshaped_tensor_is_named_with_shapes(moe_folder, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    folder = edited_copy(moe_folder, tmp_path / "s", shrink)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \[32, 64\], "
                                              r"model expects \[64, 64\]"):
        load_model(folder)


def test_misshaped_expert_is_named(moe_folder, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(64, 16)
    folder = edited_copy(moe_folder, tmp_path / "e", shrink)
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj\.weight' has shape \[64, 16\]"):
        load_model(folder)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*supported:.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    config = TINY_CONFIGS["qwen2"]()
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"rope_scaling type 'dynamic' is not supported"):
        load_model(tmp_path)


def test_missing_config_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


def test_missing_weights_file_is_reported(moe_folder, tmp_path):
    (tmp_path / "config.json").write_text((moe_folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model(tmp_path)


# ---------------------------------------------------------------------------- EAGLE heads

def rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, heads, D] rotated for positions 0..S-1 (half-split layout)."""
    seq, _, dim = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(seq).float()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    first, second = x[..., :dim // 2], x[..., dim // 2:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rms_reference(x, weight, eps=1e-6):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def attention_reference(x, w, prefix, heads, kv_heads, theta):
    """Full-sequence causal attention, no cache."""
    seq = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).view(seq, heads, -1)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).view(seq, kv_heads, -1)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).view(seq, kv_heads, -1)
    q, k = rope_reference(q, theta), rope_reference(k, theta)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, -1)
    return out @ w[f"{prefix}.o_proj.weight"].T


def mlp_reference(x, w, prefix):
    gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def eagle_reference(w, config, ids, hidden):
    """EAGLE-1: logits and output hidden per position of the full sequence."""
    x = torch.cat([w["embed_tokens.weight"][ids], hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    normed = rms_reference(x, w["layers.0.input_layernorm.weight"]) if "layers.0.input_layernorm.weight" in w else x
    h = x + attention_reference(normed, w, "layers.0.self_attn", config["num_attention_heads"],
                                config["num_key_value_heads"], config["rope_theta"])
    out = h + mlp_reference(rms_reference(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp")
    return out, out @ w["lm_head.weight"].T


def eagle3_reference(w, config, ids, hidden_rows):
    """EAGLE-3: rows of width 3H go through fc first."""
    hidden = torch.stack([w["fc.weight"] @ row if row.shape[0] != config["hidden_size"] else row
                          for row in hidden_rows])
    x = torch.cat([rms_reference(w["embed_tokens.weight"][ids], w["midlayer.input_layernorm.weight"]),
                   rms_reference(hidden, w["midlayer.hidden_norm.weight"])], -1)
    h = hidden + attention_reference(x, w, "midlayer.self_attn", config["num_attention_heads"],
                                     config["num_key_value_heads"], config["rope_theta"])
    out = h + mlp_reference(rms_reference(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.mlp")
    return out, rms_reference(out, w["norm.weight"]) @ w["lm_head.weight"].T


def head_config(architecture: str, target_config, **extra) -> dict:
    return {"architectures": [architecture], "model_type": "llama", "hidden_size": target_config.hidden_size,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "vocab_size": target_config.vocab_size, "hidden_act": "silu", **extra}


def random_weights(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=generator) * (0.1 if len(shape) > 1 else 0.2)
                   + (1.0 if len(shape) == 1 else 0.0)) for name, shape in shapes.items()}


def layer_shapes(prefix: str, hidden: int, attn_in: int, inter: int = 96, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16) -> dict[str, tuple]:
    return {f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, attn_in),
            f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, attn_in),
            f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, attn_in),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden), f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            f"{prefix}.post_attention_layernorm.weight": (hidden,)}


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    """(Tandem target, its config, the HF model it came from): the llama with tied embeddings."""
    hf_model = random_hf_model("llama")
    folder = tmp_path_factory.mktemp("eagle_target")
    hf_model.save_pretrained(folder)
    return (*load_model(folder), hf_model)


def write_head(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return folder


def with_target_weights(weights: dict, target) -> dict:
    """The reference's view: the head's own weights, plus the target's where it has none."""
    full = dict(weights)
    full.setdefault("embed_tokens.weight", target.embed_tokens.weight.detach())
    full.setdefault("lm_head.weight", target.lm_head_weight().detach())
    return full


# Head schedules: sequence 0 prefills 5 tokens, then decodes; sequence 1 (3 tokens) joins later.
# EAGLE-1 mixes a prefill with a decode in one forward; EAGLE-3 cannot (prefill rows are 3H
# wide aux states, decode rows H wide), so its schedule keeps them in separate forwards.
HEAD_SCHEDULE = [[(0, 5)], [(0, 1), (1, 3)], [(1, 1), (0, 1)], [(0, 1), (1, 1)]]
EAGLE3_SCHEDULE = [[(0, 5)], [(0, 1)], [(1, 3)], [(1, 1), (0, 1)], [(0, 1), (1, 1)]]


def check_head(head, config, reference, hidden_inputs, sequences, schedule):
    """Runs the head over `schedule` where every prefill row reads `hidden_inputs` and every
    decode row reads the head's own previous output; compares with `reference`."""
    inputs = [list(rows) for rows in hidden_inputs]     # per sequence, per position: the hidden fed

    def forward(ids, batch, spans):
        rows = []
        for seq, positions in spans:
            for p in positions:
                if p >= len(hidden_inputs[seq]):            # a decode row: feed back the last output
                    inputs[seq].append(previous[seq])
                rows.append(inputs[seq][p])
        widths = {r.shape[0] for r in rows}
        assert len(widths) == 1, "one forward gets one hidden width in this test"
        out = head(ids, torch.stack(rows), batch)
        offset = 0
        for seq, positions in spans:
            offset += len(positions)
            previous[seq] = out[offset - 1]
        return torch.cat([out, head.compute_logits(out)], -1)

    previous: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        results = run_schedule(forward, head.kv_layout(), schedule, sequences)
    hidden_size = config["hidden_size"]
    for seq, result in enumerate(results):
        out, logits = reference(torch.tensor(sequences[seq][:len(result)]), inputs[seq][:len(result)])
        assert (result[:, :hidden_size] - out).abs().max() <= TOL
        assert (result[:, hidden_size:] - logits).abs().max() <= TOL


def random_hidden_rows(lengths, width, seed):
    generator = torch.Generator().manual_seed(seed)
    return [list(torch.randn(n, width, generator=generator)) for n in lengths]


@pytest.mark.parametrize("own_weights", [False, True], ids=["shared-embed-head", "own-embed-head-and-norm"])
def test_eagle_head_matches_reference(llama_target, tmp_path, own_weights):
    target, target_config, _ = llama_target
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    config = head_config("LlamaForCausalLMEagle", target_config)
    shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,), **layer_shapes("layers.0", hidden, hidden)}
    if own_weights:
        shapes.update({"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                       "layers.0.input_layernorm.weight": (hidden,)})
    weights = random_weights(shapes, seed=11)
    head, _ = load_draft(write_head(tmp_path / "eagle", config, weights), target)
    assert head.kv_layout() == (1, 2, 16)
    sequences = random_sequences(sequence_lengths(HEAD_SCHEDULE), seed=5)
    full = with_target_weights(weights, target)
    reference = lambda ids, rows: eagle_reference(full, config, ids, torch.stack(rows))  # noqa: E731
    # Prefill rows read target-like hidden states (H wide), decode rows the head's own output.
    check_head(head, config, reference, random_hidden_rows([5, 3], hidden, seed=6), sequences,
               HEAD_SCHEDULE)


@pytest.mark.parametrize("draft_vocab", [120, VOCAB], ids=["reduced-vocab", "full-vocab-shared-head"])
def test_eagle3_head_matches_reference(llama_target, tmp_path, draft_vocab):
    target, target_config, _ = llama_target
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    config = head_config("LlamaForCausalLMEagle3", target_config, draft_vocab_size=draft_vocab,
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    shapes = {"fc.weight": (hidden, 3 * hidden), "midlayer.input_layernorm.weight": (hidden,),
              "midlayer.hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
              **layer_shapes("midlayer", hidden, 2 * hidden)}
    if draft_vocab != vocab:
        shapes["lm_head.weight"] = (draft_vocab, hidden)
    weights = random_weights(shapes, seed=12)
    if draft_vocab != vocab:
        draft_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:draft_vocab].sort().values
        weights["d2t"] = draft_ids - torch.arange(draft_vocab)
        weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True)
    head, _ = load_draft(write_head(tmp_path / "eagle3", config, weights), target)
    assert head.capture_layers == [1, 2, 3] and target.aux_layer_ids == [1, 2, 3]
    sequences = random_sequences(sequence_lengths(EAGLE3_SCHEDULE), seed=7)
    full = with_target_weights(weights, target)
    reference = lambda ids, rows: eagle3_reference(full, config, ids, rows)  # noqa: E731
    check_head(head, config, reference, random_hidden_rows([5, 3], 3 * hidden, seed=8), sequences,
               EAGLE3_SCHEDULE)
    draft = torch.arange(draft_vocab)
    mapped = head.draft_to_target(draft)
    assert torch.equal(mapped, draft_ids if draft_vocab != vocab else draft)
    target.set_aux_capture_layers([])


def test_head_with_unexpected_tensor_is_refused(llama_target, tmp_path):
    target, target_config, _ = llama_target
    hidden = target_config.hidden_size
    shapes = {"fc.weight": (hidden, 2 * hidden), **layer_shapes("layers.0", hidden, hidden),
              "layers.1.mlp.up_proj.weight": (4, 4)}
    config = head_config("LlamaForCausalLMEagle", target_config)
    folder = write_head(tmp_path / "bad", config, random_weights(shapes, 1))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: layers\.1\.mlp\.up_proj\.weight"):
        load_draft(folder, target)


# ---------------------------------------------------------------------------- embedded checkpoints

EMBEDDED = ["tandem-dense", "tandem-moe", "tandem-dense-eagle", "tandem-dense-eagle3", "tandem-moe-eagle",
            "tandem-dense-draft"]
EMBEDDED += sorted({p.parent.name for p in (REPO / "models").glob("*/config.json")} - set(EMBEDDED))
HEAD_ARCHITECTURES = {"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3"}


def embedded_folder(name: str) -> Path:
    folder = REPO / "models" / name
    if not (folder / "config.json").is_file():
        pytest.fail(f"models/{name} is not there yet (no config.json)")
    return folder


def architecture(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["architectures"][0]


def prompt_ids(folder: Path, vocab: int) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens"
    try:
        ids = [i for i in transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"] if i < vocab]
    except Exception:  # no usable tokenizer files
        ids = []
    if len(ids) < 12:   # too short for the schedules: any ids will do
        ids = random_sequences([16], seed=9, vocab=vocab)[0]
    return ids[:24]


@torch.no_grad()
def greedy_continuation(hf_model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_checkpoint(name):
    folder = embedded_folder(name)
    if architecture(folder) in HEAD_ARCHITECTURES:
        check_embedded_head(name, folder)
        return
    model, config = load_model(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = prompt_ids(folder, config.vocab_size)
    sequence = greedy_continuation(hf_model, prompt, steps=4)
    schedule = [[(0, len(prompt))]] + [[(0, 1)]] * 4           # prefill, then decode the greedy tokens
    ours = tandem_logits(model, schedule, [sequence])
    reference = hf_logits(hf_model, [sequence])
    scale = max(1.0, reference[0].abs().max().item())
    assert max_diff(ours, reference) <= TOL * scale


def embedded_target_of(head_name: str) -> Path:
    candidates = [p.parent for p in (REPO / "models").glob("*/config.json")
                  if head_name.startswith(p.parent.name + "-") and architecture(p.parent) not in HEAD_ARCHITECTURES]
    if not candidates:
        pytest.fail(f"no target checkpoint in models/ for {head_name}")
    return max(candidates, key=lambda p: len(p.name))


def check_embedded_head(name: str, folder: Path) -> None:
    target_folder = embedded_target_of(name)
    target, target_config = load_model(target_folder)
    sequences = [prompt_ids(folder, target_config.vocab_size)[:10],
                 random_sequences([8], 10, target_config.vocab_size)[0]]
    tiny_heads = tiny_heads_module()
    if tiny_heads is not None:
        hf_target = transformers.AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
        check_against_tiny_heads(tiny_heads, folder, hf_target, target, sequences)
    else:
        check_against_formulas(folder, target, sequences)


def check_against_formulas(folder: Path, target, sequences) -> None:
    """The head vs the in-test reference, fed the Tandem target's hidden states."""
    head, head_config_ = load_draft(folder, target)
    config = dict(vars(head_config_))
    config.setdefault("rope_theta", (getattr(head_config_, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    with safe_open(folder / "model.safetensors", "pt") as f:
        weights = with_target_weights({k: f.get_tensor(k).float() for k in f.keys()}, target)
    is_eagle3 = architecture(folder) == "LlamaForCausalLMEagle3"
    with torch.no_grad():
        hidden_inputs = []
        for seq in sequences:
            ids, batch = PagedRunner(target.kv_layout(), torch.float32).step([(0, seq)])
            out = target(ids, batch, capture_aux=is_eagle3)
            hidden_inputs.append(list(out.aux_hidden if is_eagle3 else out.hidden))
    if is_eagle3:
        reference = lambda ids, rows: eagle3_reference(weights, config, ids, rows)  # noqa: E731
    else:
        reference = lambda ids, rows: eagle_reference(weights, config, ids, torch.stack(rows))  # noqa: E731
    run_head_check(head, config["hidden_size"], reference, hidden_inputs, sequences, is_eagle3)
    target.set_aux_capture_layers([])


def run_head_check(head, hidden_size, reference, hidden_inputs, sequences, is_eagle3):
    schedule = EAGLE3_SCHEDULE if is_eagle3 else HEAD_SCHEDULE
    sequences = [seq[:n] for seq, n in zip(sequences, sequence_lengths(schedule))]
    hidden_inputs = [rows[:n] for rows, n in zip(hidden_inputs, [5, 3])]     # the prefill rows
    check_head(head, {"hidden_size": hidden_size}, reference, hidden_inputs, sequences, schedule)


# ---------------------------------------------------------------------------- tools/tiny_heads.py

def tiny_heads_module():
    """tools/tiny_heads.py (the heads' training-side reference), if it is there."""
    path = REPO / "tools" / "tiny_heads.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("tiny_heads_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module if hasattr(module, "EagleHead") and hasattr(module, "Eagle3Head") else None


def check_against_tiny_heads(tiny_heads, folder: Path, hf_target, target, sequences) -> None:
    """The head vs tiny_heads' module on the same checkpoint; the prefill rows read the HF
    target's features (which Tandem's target must reproduce, aux capture included)."""
    reference_head = tiny_heads.load_head(folder, hf_target, torch.float32).eval()
    head, config = load_draft(folder, target)
    is_eagle3 = isinstance(reference_head, tiny_heads.Eagle3Head)
    capture = reference_head.capture_layers if is_eagle3 else []
    if is_eagle3:
        assert head.capture_layers == capture
    hidden_inputs = []
    with torch.no_grad():
        for seq in sequences:
            _, final, aux = tiny_heads.target_features(hf_target, torch.tensor([seq]), capture)
            expected = (aux if is_eagle3 else final)[0]
            ids, batch = PagedRunner(target.kv_layout(), torch.float32).step([(0, seq)])
            out = target(ids, batch, capture_aux=is_eagle3)
            ours = out.aux_hidden if is_eagle3 else out.hidden
            assert (ours - expected).abs().max() <= TOL * max(1.0, expected.abs().max().item())
            hidden_inputs.append(list(expected))

    def reference(ids, rows):
        with torch.no_grad():
            if is_eagle3:
                rows = [reference_head.project(r) if r.shape[0] != config.hidden_size else r for r in rows]
            out = reference_head(ids[None], torch.stack(rows)[None])[0]
            return out, reference_head.logits(out)

    run_head_check(head, config.hidden_size, reference, hidden_inputs, sequences, is_eagle3)
    if is_eagle3:
        draft = torch.arange(head.draft_vocab_size)
        assert torch.equal(head.draft_to_target(draft), reference_head.to_target(draft))
    target.set_aux_capture_layers([])


@pytest.mark.parametrize("kind", ["EagleHead", "Eagle3Head"])
def test_heads_match_tiny_heads_reference(llama_target, tmp_path, kind):
    """Random heads written by tools/tiny_heads.py itself load and run identically in Tandem."""
    tiny_heads = tiny_heads_module()
    if tiny_heads is None:
        pytest.fail("tools/tiny_heads.py is not there")
    target, target_config, hf_target = llama_target
    draft_vocab = 120
    config = head_config("LlamaForCausalLMEagle3" if kind == "Eagle3Head" else "LlamaForCausalLMEagle",
                         target_config, draft_vocab_size=draft_vocab,
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]})
    torch.manual_seed(13)
    reference_head = getattr(tiny_heads, kind)(config, hf_target)
    with torch.no_grad():
        for param in reference_head.parameters():
            param.normal_(0.0, 0.1) if param.dim() > 1 else param.normal_(1.0, 0.1)
        if kind == "Eagle3Head":
            draft_ids = torch.randperm(target_config.vocab_size)[:draft_vocab].sort().values
            reference_head.d2t.copy_(draft_ids - torch.arange(draft_vocab))
            reference_head.t2d.index_fill_(0, draft_ids, True)
    reference_head.save_pretrained(tmp_path / kind)
    check_against_tiny_heads(tiny_heads, tmp_path / kind, hf_target, target, random_sequences([8, 5], seed=14))


def test_chain_step_batch_attends_like_the_general_builder():
    """The draft chain's shared-table batch gives the same attention as a fresh single-query build."""
    from engine.models.attention import KVCache, build_attention_batch, chain_step_batch, paged_attention
    gen = torch.Generator().manual_seed(0)
    kv = KVCache.allocate(1, 64, 2, 8, torch.float32)
    kv.k[0].normal_(generator=gen)
    kv.v[0].normal_(generator=gen)
    table = torch.randperm(64, generator=gen)[:48].view(3, 16)
    rows = torch.tensor([2, 0])
    positions = torch.tensor([5, 11])
    q, k, v = (torch.randn(2, h, 8, generator=gen) for h in (4, 2, 2))
    outs = []
    ones = torch.ones(2, dtype=torch.long)
    for batch in (build_attention_batch(ones, positions + 1, rows, table, 1, 14, kv, tokens=2),
                  chain_step_batch(positions, table[rows, :14], kv)):
        snapshot = KVCache(k=[kv.k[0].clone()], v=[kv.v[0].clone()])
        outs.append(paged_attention(q, k, v, 0, batch.with_kv(snapshot), 8 ** -0.5))
    torch.testing.assert_close(outs[0], outs[1])


def test_decodes_and_prompt_chunks_attend_apart_like_one_padded_batch():
    """A batch of decodes around prompt chunks: attention_groups pads each group to its own widths
    (the decodes to one query), and the output is that of the whole batch padded to its widest."""
    from engine.models.attention import KVCache, attention_groups, build_attention_batch, paged_attention
    gen = torch.Generator().manual_seed(1)
    kv = KVCache.allocate(1, 256, 2, 8, torch.float32)
    kv.k[0].normal_(generator=gen)
    kv.v[0].normal_(generator=gen)
    table = torch.randperm(256, generator=gen)[:240].view(4, 60)
    q_lens, kv_lens, rows = [1, 9, 1, 4], [30, 9, 51, 20], [3, 0, 2, 1]      # decode, chunk, decode, chunk
    groups = attention_groups(q_lens, kv_lens, "cpu")
    assert [(g.seqs.tolist(), g.max_q, g.max_k, g.tokens) for g in groups] == [([0, 2], 1, 51, 2), ([1, 3], 9, 20, 13)]
    assert attention_groups([1, 1], [5, 9], "cpu") is None and attention_groups([3, 4], [5, 9], "cpu") is None
    tokens = sum(q_lens)
    q, k, v = (torch.randn(tokens, h, 8, generator=gen) for h in (4, 2, 2))
    long = lambda values: torch.tensor(values)  # noqa: E731
    outs = []
    for split in (None, groups):
        batch = build_attention_batch(long(q_lens), long(kv_lens), long(rows), table, 9, 51, kv, groups=split,
                                      tokens=tokens)
        assert len(batch.parts) == (1 if split is None else 2)
        snapshot = KVCache(k=[kv.k[0].clone()], v=[kv.v[0].clone()])
        outs.append(paged_attention(q, k, v, 0, batch.with_kv(snapshot), 8 ** -0.5))
    assert outs[1].shape == (tokens, 4, 8)
    torch.testing.assert_close(outs[1], outs[0])
