"""A target checkpoint's config.json as the model builders read it, without transformers.

Importing transformers to read one small JSON file cost a rank about 20 MB of resident memory
(the default server's rank: 388 -> 366 MB PSS) and about half a second at every start. The
builders read a few dozen fields (engine/models/*.py: sizes, norms, RoPE, attention and MoE
settings); a field config.json leaves out takes the value transformers' config class of that
architecture gives it, from ARCHITECTURE_DEFAULTS, and the fields transformers derives from
others are derived the same way (`derive`).

tests/test_model_config.py builds every target architecture from this reader and from
transformers' AutoConfig, on minimal and on full configs, and compares what the builders make
of them: a default changed upstream shows there, not as a silently different model.
"""
from __future__ import annotations

from types import SimpleNamespace

# Fields every builder reads; without them there is no model to build.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

# What transformers' config class of each architecture gives a field the file leaves out, where
# the builders' own fallbacks differ (engine/models/layers.py: config_value, head_dim_of,
# rope_parameters: head_dim hidden/heads, KV heads = attention heads, rope_theta 10000, silu,
# untied embeddings).
ARCHITECTURE_DEFAULTS: dict[str, dict] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "attention_bias": False,
                         "mlp_bias": False, "eos_token_id": 2},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 32,
                         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 32,
                         "head_dim": 128, "attention_bias": False, "use_sliding_window": False,
                         "sliding_window": 4096, "max_window_layers": 28},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 4,
                            "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
                            "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                           "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2, "eos_token_id": 2},
}


# Names transformers' config class of the architecture reads as another (its attribute_map).
ALIASES: dict[str, dict[str, str]] = {
    "Qwen3MoeForCausalLM": {"num_experts": "num_local_experts"},
    "MixtralForCausalLM": {"num_experts": "num_local_experts"},
}

# Architectures whose layer_types transformers derives from the sliding-window fields.
LAYER_TYPES_DERIVED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


class ConfigError(ValueError):
    """config.json lacks what the builders need."""


def target_config(fields: dict) -> SimpleNamespace:
    """config.json's fields (a target architecture's) with the defaults and derived fields
    transformers would give them, as attributes."""
    architecture = (fields.get("architectures") or [None])[0]
    if architecture not in ARCHITECTURE_DEFAULTS:
        raise ConfigError(f"no config defaults for architecture {architecture!r}; "
                          f"known: {sorted(ARCHITECTURE_DEFAULTS)}")
    missing = [name for name in REQUIRED if fields.get(name) is None]
    if missing:
        raise ConfigError(f"config.json of {architecture} lacks {', '.join(missing)}")
    aliases = ALIASES.get(architecture, {})
    fields = {aliases.get(name, name): value for name, value in fields.items()}
    config = {**ARCHITECTURE_DEFAULTS[architecture], **fields}
    config.update({alias: config[name] for alias, name in aliases.items() if name in config})
    derive(architecture, config)
    return SimpleNamespace(**config)


def derive(architecture: str, config: dict) -> None:
    """The fields transformers computes from others that the builders do not (a null KV-head count
    or head_dim, which overrides the default, the builders' fallbacks already compute)."""
    if not config.get("use_sliding_window", True):
        config["sliding_window"] = None                 # the window exists only where it is used
    if architecture in LAYER_TYPES_DERIVED and config.get("layer_types") is None:
        window, first = config.get("sliding_window"), config.get("max_window_layers", 0)
        config["layer_types"] = ["sliding_attention" if window is not None and i >= first else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
