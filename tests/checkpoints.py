"""Random tiny checkpoints in Hugging Face layout, for engine tests that need a model
but not a trained one (losslessness does not depend on how good a draft is)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def random_target(folder: Path, arch: str = "llama", vocab: int = 512, hidden: int = 64, layers: int = 3,
                  seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                  eos_token_id=1, bos_token_id=1)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=2 * hidden, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=hidden, intermediate_size=2 * hidden,
                                                   norm_topk_prob=True, **common))
    # Sharper logits than the default init, so greedy choices are not near-ties.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def random_head(folder: Path, target: Path, eagle3: bool = False, draft_vocab: int = 256, seed: int = 1) -> Path:
    """An EAGLE (or EAGLE-3) head for `target`, in SGLang's layout, with random weights."""
    config = json.loads((target / "config.json").read_text())
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    attn_in = 2 * hidden if eagle3 else hidden
    prefix = "midlayer" if eagle3 else "layers.0"
    weights = {f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
               f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
               f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
               f"{prefix}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
               f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
               f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
               f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden)}
    head_config = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
                   "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
                   "vocab_size": vocab, "hidden_act": "silu"}
    if eagle3:
        aux = [0, layers // 2, layers - 1]
        weights.update({"fc.weight": rand(hidden, 3 * hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
                        "midlayer.hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
                        "lm_head.weight": rand(draft_vocab, hidden),
                        "d2t": torch.zeros(draft_vocab, dtype=torch.long),
                        "t2d": torch.zeros(vocab, dtype=torch.bool)})
        weights["t2d"][:draft_vocab] = True
        head_config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    else:
        weights.update({"fc.weight": rand(hidden, 2 * hidden), "fc.bias": torch.zeros(hidden)})
        head_config.update(architectures=["LlamaForCausalLMEagle"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head_config))
    save_file(weights, folder / "model.safetensors")
    return folder
