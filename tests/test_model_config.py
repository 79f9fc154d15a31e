"""The rank reads a target's config.json without transformers (engine/models/config.py): for
every target architecture, on minimal files (sizes only: every other field from the defaults)
and on files that set the fields the defaults cover, the model built from that reader must
be the one built from transformers' AutoConfig: the same tensors, the same settings in every
module, the same RoPE frequencies, context length, eos ids and refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.base import ARCHITECTURES, DraftHead, model_class
from engine.models.config import ARCHITECTURE_DEFAULTS
from engine.models.loader import CheckpointError, read_target_config
from engine.rank_main import eos_token_ids

transformers = pytest.importorskip("transformers")

# a multiple of every default number of KV heads (4, 8, 32) and none of them: the minimal files
# must build, and a default KV-head count shows against the builders' fallback (= attention heads)
SIZES = {"vocab_size": 96, "hidden_size": 256, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 64}
MOE_SIZES = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
# the expert count under the name the architecture's checkpoints use (transformers reads both)
EXPERTS_NAME = {"Qwen3MoeForCausalLM": "num_experts", "MixtralForCausalLM": "num_local_experts"}
OTHER_NAME = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}
TARGETS = sorted(name for name in ARCHITECTURES if not issubclass(model_class(name), DraftHead))

# Files that set what the defaults would otherwise give, one variant per line.
VARIANTS = {
    "minimal": {},
    "explicit": {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
                 "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True, "eos_token_id": [5, 7]},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "rope-scaling": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "moe-settings": {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [0]},
    # a window that no layer uses (transformers derives layer_types) and one that is used
    "window-unused": {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 8,
                      "max_position_embeddings": 64},
    "window-off": {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 1},
    "window-on": {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    "null-fields": {"head_dim": None, "num_key_value_heads": None, "sliding_window": None},
    "other-experts-name": {},
}


def write_config(folder, architecture: str, extra: dict, other_experts_name: bool = False) -> None:
    fields = {"architectures": [architecture], "model_type": model_type(architecture), **SIZES, **extra}
    if architecture in EXPERTS_NAME:
        name = EXPERTS_NAME[architecture]
        fields = {**MOE_SIZES, (OTHER_NAME[name] if other_experts_name else name): 4, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))


def model_type(architecture: str) -> str:
    return {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}[architecture]


def build(architecture: str, config):
    """The model the builders make of `config` (on meta: no weights), or the error they raise."""
    try:
        with torch.device("meta"):
            return model_class(architecture)(config)
    except ValueError as exc:
        return f"refused: {exc}"


def settings(model) -> dict:
    """Every module's plain settings, tensor shapes, and the RoPE frequencies: what the builders
    made of the config."""
    if isinstance(model, str):
        return {"refused": model}
    found = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "config" and isinstance(value, (bool, int, float, str, tuple)):
                found[f"{name}.{key}"] = value
    found.update({f"{name}.shape": tuple(t.shape) for name, t in model.state_dict().items()})
    found["inv_freq"] = model.rotary.inv_freq.tolist()
    return found


def test_every_target_architecture_has_defaults():
    assert sorted(ARCHITECTURE_DEFAULTS) == TARGETS


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("architecture", TARGETS)
def test_builders_read_what_autoconfig_gives(architecture, variant, tmp_path):
    write_config(tmp_path, architecture, VARIANTS[variant], other_experts_name=variant == "other-experts-name")
    ours = read_target_config(tmp_path)
    try:
        theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    except Exception:                           # noqa: BLE001 (the strict-dataclass error types vary)
        assert variant == "null-fields"         # some classes refuse nulls; the reader takes them as unset
        return
    built = settings(build(architecture, ours))
    assert built == settings(build(architecture, theirs))
    assert "refused" not in built or variant.startswith("window")
    assert ours.max_position_embeddings == theirs.max_position_embeddings     # the context length
    assert ours.vocab_size == theirs.vocab_size
    assert eos_token_ids(str(tmp_path), ours) == eos_token_ids(str(tmp_path), theirs)


def test_embedded_models_read_as_transformers_reads_them():
    from engine.args import DEFAULT_MODEL
    for folder in Path(DEFAULT_MODEL).parent.iterdir():
        config = json.loads((folder / "config.json").read_text())
        if config["architectures"][0] not in ARCHITECTURE_DEFAULTS:
            continue                                            # draft heads: plain JSON already
        architecture = config["architectures"][0]
        ours, theirs = read_target_config(folder), transformers.AutoConfig.from_pretrained(folder)
        assert settings(build(architecture, ours)) == settings(build(architecture, theirs)), folder.name


def test_a_config_without_sizes_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="lacks vocab_size, num_hidden_layers, num_attention_heads"):
        read_target_config(tmp_path)


def test_a_draft_head_is_not_read_as_a_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"], **SIZES}))
    with pytest.raises(CheckpointError, match="holds a draft head"):
        read_target_config(tmp_path)
