"""A Llama-shaped checkpoint with random weights at a real model's size, for the benchmarks.

    python bench/make_model.py 270m                          # .build/models/llama-270m (float32)
    python bench/make_model.py 1b --dtype bfloat16 --eagle   # .build/models/llama-1b-bf16 and llama-1b-bf16-eagle
    python bench/make_model.py tiny --layers 3 --out /tmp/tiny

Writes config.json (LlamaForCausalLM), model.safetensors and the embedded model's tokenizer files
(models/tandem-dense: its vocabulary sets vocab_size), so that Tandem, transformers, llama.cpp's converter and
vLLM all load the folder and the load tools make prompts for it as for the embedded models. Weights are
normal with std 0.02 (norms ones), drawn from --seed in float32 and stored in --dtype, so the bfloat16 model
is the float32 one rounded. --eagle also writes a random EAGLE-1 head for the target into `<out>-eagle`, in
models/tandem-dense-eagle's layout (SGLang's LlamaForCausalLMEagle: one layer of the target's shape, embeddings
and LM head shared from the target), so that speculation can be timed at the same size; its acceptance means
nothing, only its cost does.

Models are made on demand into .build/models/ (git-ignored) and never committed. The recipe (shape, dtype,
seed) is kept in the safetensors metadata: a folder already made from the same recipe is reused, any other is
rewritten.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "models" / "tandem-dense"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
MODELS_DIR = REPO / ".build" / "models"
INIT_STD = 0.02
DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16"}
CHUNK_ELEMENTS = 1 << 24            # values drawn at a time: a large tensor never has a float32 copy whole


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    context: int = 4096

    def check(self) -> None:
        if min(asdict(self).values()) < 1:
            raise ValueError("model sizes must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError("--head-dim must be even (rotary embeddings rotate pairs)")


SIZES = {
    "tiny": Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128),
    # A small real checkpoint's proportions, at the embedded tokenizer's vocabulary.
    "270m": Shape(layers=24, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816),
    # Llama-3.2-1B's layer shape.
    "1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192),
}


# ---- configs and tensor shapes --------------------------------------------------------------

def tokenizer_vocab() -> int:
    return json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]


def llama_config(shape: Shape, vocab: int, dtype: str) -> dict:
    # rope_theta is written both ways: transformers 5 reads rope_parameters, older readers (llama.cpp's
    # converter, vLLM) rope_theta.
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "max_position_embeddings": shape.context, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "rope_theta": 500000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "initializer_range": INIT_STD,
            "use_cache": True, "torch_dtype": dtype, "dtype": dtype}


def eagle_config(target: dict) -> dict:
    """models/tandem-dense-eagle's config.json with the target's sizes."""
    keep = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "attention_bias", "mlp_bias")
    return {"architectures": ["LlamaForCausalLMEagle"], **{k: target[k] for k in keep}, "num_hidden_layers": 1,
            "rope_scaling": None, "tie_word_embeddings": False}


def layer_shapes(config: dict, prefix: str, input_norm: bool = True) -> dict[str, tuple[int, ...]]:
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
              "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "post_attention_layernorm.weight": (hidden,)}
    if input_norm:
        shapes["input_layernorm.weight"] = (hidden,)
    return {f"{prefix}{name}": shape for name, shape in shapes.items()}


def target_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an untied Llama checkpoint (Hugging Face names) and its shape."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        shapes.update(layer_shapes(config, f"model.layers.{i}."))
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def eagle_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """An EAGLE-1 head's tensors: fc over [embedding, feature], one layer without an input norm (the target's
    normed hidden state comes in), no embeddings, LM head or final norm (shared from the target)."""
    hidden = config["hidden_size"]
    return {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
            **layer_shapes(config, "layers.0.", input_norm=False)}


# ---- weights -------------------------------------------------------------------------------

def random_weights(shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> dict:
    """Normal(0, INIT_STD) matrices drawn in float32 a chunk of rows at a time and stored in `dtype`; norm
    weights ones, biases zeros."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    stored = getattr(torch, dtype)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = (torch.zeros if name.endswith(".bias") else torch.ones)(shape, dtype=stored)
            continue
        tensor = torch.empty(shape, dtype=stored)
        rows = max(1, CHUNK_ELEMENTS // shape[1])
        for start in range(0, shape[0], rows):
            part = tensor[start:start + rows]
            part.copy_(torch.randn(part.shape, generator=generator) * INIT_STD)
        weights[name] = tensor
    return weights


def recipe_of(folder: Path) -> dict | None:
    """The recipe a folder was made from (safetensors metadata), or None."""
    from safetensors import safe_open
    try:
        with safe_open(folder / "model.safetensors", "pt") as f:
            return json.loads((f.metadata() or {}).get("tandem_recipe", "null"))
    except (OSError, ValueError):
        return None


def write_checkpoint(folder: Path, config: dict, weights: dict, recipe: dict, tokenizer: bool) -> None:
    """Into a temporary sibling, renamed at the end: an interrupted run leaves no half-written model that a
    later run would take for a whole one."""
    from safetensors.torch import save_file
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt", "tandem_recipe": json.dumps(recipe)})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES if tokenizer else ():
        shutil.copy(TOKENIZER / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def make(folder: Path, config: dict, shapes: dict, recipe: dict, seed: int, tokenizer: bool) -> str:
    """Write one checkpoint unless the folder already holds this recipe; says which."""
    if recipe_of(folder) == recipe and (folder / "config.json").is_file():
        return "already made"
    write_checkpoint(folder, config, random_weights(shapes, config["torch_dtype"], seed), recipe, tokenizer)
    return "made"


def parameters(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


def make_model(args) -> Path:
    """The target (and with --eagle its head) of args' size; returns the target's folder."""
    vocab = tokenizer_vocab()
    config = llama_config(args.shape, vocab, args.dtype)
    shapes = target_shapes(config)
    recipe = {"shape": asdict(args.shape), "vocab": vocab, "dtype": args.dtype, "seed": args.seed}
    done = make(args.out, config, shapes, recipe, args.seed, tokenizer=True)
    size = parameters(shapes)
    print(f"{args.out}: {done}; Llama-shaped, {size / 1e6:.1f}M parameters in {args.dtype} "
          f"({(args.out / 'model.safetensors').stat().st_size / 1e9:.2f} GB), random weights, seed {args.seed}")
    if args.eagle:
        head = args.out.with_name(args.out.name + "-eagle")
        head_shapes = eagle_shapes(config)
        done = make(head, eagle_config(config), head_shapes, {**recipe, "eagle": True}, args.seed + 1, tokenizer=False)
        print(f"{head}: {done}; EAGLE-1 head, {parameters(head_shapes) / 1e6:.1f}M parameters")
    return args.out


# ---- arguments and main ---------------------------------------------------------------------

OVERRIDES = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "context")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("size", choices=sorted(SIZES), help="The model's shape; the flags below change parts of it.")
    parser.add_argument("--dtype", choices=sorted(DTYPE_SUFFIX), default="float32", help="Stored weight type.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the target's weights (the head's: seed + 1).")
    parser.add_argument("--out", default=None,
                        help=f"Folder to write (default: {MODELS_DIR.relative_to(REPO)}/llama-SIZE[-bf16]).")
    parser.add_argument("--eagle", action="store_true", help="Also write a random EAGLE-1 head into OUT-eagle.")
    shape = parser.add_argument_group("the shape, against the named size's")
    for name in OVERRIDES:
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    changes = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    args.shape = replace(SIZES[args.size], **changes)
    try:
        args.shape.check()
    except ValueError as exc:
        parser.error(str(exc))
    custom = "-custom" if changes else ""
    args.out = Path(args.out) if args.out else MODELS_DIR / f"llama-{args.size}{custom}{DTYPE_SUFFIX[args.dtype]}"
    return args


def main(argv: list[str] | None = None) -> int:
    make_model(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
