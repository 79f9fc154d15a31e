"""Load Hugging Face safetensors checkpoints into Tandem's model classes.

    model, config = load_model(path, dtype, device)          # a target (CausalLM)
    head, config = load_draft(path, target, dtype, device)   # an EAGLE head, bound to the target
    hot_ids = load_token_map(path, vocab_size)               # a token map: head.restrict_vocab(hot_ids)

The model is built on the `meta` device (no init cost), then every parameter and persistent
buffer is assigned from the checkpoint. Checkpoint names map to Tandem names by:

  1. dropping the `model.` prefix (HF targets; EAGLE files usually have none),
  2. the class's `checkpoint_renames` (Mixtral: block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down),
  3. stacking per-expert `....experts.N.{gate,up,down}_proj.weight` into the [E, ...] tensors
     `....experts.gate_up_proj` / `....experts.down_proj` (see moe.py).

The checkpoint must then provide exactly the model's tensors, with the model's shapes; anything
else is a CheckpointError naming the tensors. Exceptions: `ignored_weights` (a tied model's
lm_head copy, rotary inv_freq caches) are skipped, and a head's `optional_weights` it lacks are
dropped from the head (`drop_weights`) before the check.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from engine.models.config import ConfigError, target_config
from engine.models.base import ARCHITECTURES, CausalLM, DraftHead, model_class
from devices.cpu_native import auto_cpu_dtype, cpu_kernels as load_cpu_kernels, return_free_memory
from engine.models.layers import stack_projections, use_cpu_kernels
from engine.models.quant import quantize, quantize_lm_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
MAX_NAMES_IN_ERROR = 12


class CheckpointError(ValueError):
    """The folder does not hold a checkpoint this model class can load."""


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str, cpu_kernels: str = "auto",
                  quantization: str | None = None) -> torch.dtype:
    """auto: bfloat16 on accelerators; on the CPU what devices/cpu_native.py: auto_cpu_dtype measured
    fastest for the CPU's features and the kernels that run."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return auto_cpu_dtype(cpu_kernels, quantization)
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


# ---------------------------------------------------------------------------- entry points

def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               cpu_kernels: str = "auto", quantization: str | None = None) -> tuple[CausalLM, object]:
    """Target model and its config (engine/models/config.py) from a local HF checkpoint folder.
    cpu_kernels: on the CPU, whether the layers run the native kernels (devices/cpu_native.py);
    quantization: of the weights after loading (engine/models/quant.py)."""
    folder = Path(path)
    config = read_target_config(folder)
    model = build_and_load(model_class(config.architectures[0]), config, folder,
                           resolve_dtype(dtype, device, cpu_kernels, quantization), device, cpu_kernels, quantization)
    finish(model, quantization)
    return model, config


def load_draft(path: str | Path, target: CausalLM, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", token_map: str | Path | None = None,
               cpu_kernels: str = "auto", quantization: str | None = None) -> tuple[DraftHead, SimpleNamespace]:
    """EAGLE / EAGLE-3 head bound to `target` (shared embeddings / LM head, aux capture layers),
    drafting only the token map's ids when one is given.
    Its config is config.json read as plain attributes (EAGLE layouts are not transformers models)."""
    folder = Path(path)
    cls = architecture_class(folder)
    if not issubclass(cls, DraftHead):
        raise CheckpointError(f"{folder} holds {cls.__name__}, not a draft head; load it with load_model()")
    config = SimpleNamespace(**read_config_json(folder))
    head = build_and_load(cls, config, folder, resolve_dtype(dtype, device, cpu_kernels, quantization), device,
                          cpu_kernels, quantization)
    head.bind_target(target)
    if token_map is not None:
        try:
            head.restrict_vocab(load_token_map(token_map, head.vocab_size))
        except ValueError as exc:
            raise CheckpointError(f"--speculative-token-map {token_map} with the head in {folder}: {exc}") from exc
    finish(head, quantization)
    return head, config


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """A token map as SGLang reads one (`torch.save` of a list or 1-D tensor of target token ids):
    the ids, sorted, as a long tensor; a clear CheckpointError for anything else."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"token map {file} does not exist")
    try:
        ids = torch.as_tensor(torch.load(file, map_location="cpu", weights_only=True))
    except Exception as exc:                    # not a torch file, or not plain data
        raise CheckpointError(f"token map {file} is not a torch.save'd list or tensor of token ids: {exc}") from exc
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise CheckpointError(f"token map {file} must hold a non-empty 1-D list of integer token ids "
                              f"(found {ids.dtype} of shape {tuple(ids.shape)})")
    ids = ids.long().sort().values
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise CheckpointError(f"token map {file} holds ids outside the target vocabulary 0..{vocab_size - 1}")
    if bool((ids[1:] == ids[:-1]).any()):
        raise CheckpointError(f"token map {file} repeats token ids")
    return ids


def read_config_json(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {folder}")
    return json.loads(config_file.read_text())


def read_target_config(folder: str | Path) -> SimpleNamespace:
    """A target's config.json with the defaults transformers would give it (engine/models/config.py)."""
    fields = read_config_json(Path(folder))
    cls = architecture_class(Path(folder), fields)
    if issubclass(cls, DraftHead):
        raise CheckpointError(f"{folder} holds a draft head ({cls.__name__}); load it with load_draft()")
    try:
        return target_config(fields)
    except ConfigError as exc:
        raise CheckpointError(f"{folder}: {exc}") from exc


def architecture_class(folder: Path, fields: dict | None = None) -> type:
    """The model class config.json names (`fields`: the file, when read already)."""
    architectures = (fields if fields is not None else read_config_json(folder)).get("architectures") or []
    if not architectures:
        raise CheckpointError(f"{folder}/config.json names no architecture; supported: {sorted(ARCHITECTURES)}")
    if architectures[0] not in ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {architectures[0]!r} in {folder}/config.json; "
                              f"supported: {sorted(ARCHITECTURES)}")
    return model_class(architectures[0])


# ---------------------------------------------------------------------------- building

class InitSkipped(TorchFunctionMode):
    """torch.nn.init's random fills made no-ops while a model is built on the meta device: every
    parameter is assigned from the checkpoint afterwards. On meta tensors torch runs those fills
    through its Python reference implementations, whose first use imports torch._dynamo and, with
    it, sympy and torch.distributed: 820 modules, about 70 MB of a rank's resident memory
    (docs/performance-history.md: "Resident memory")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_and_load(cls: type, config, folder: Path, dtype: torch.dtype, device: torch.device | str,
                   cpu_kernels: str = "auto", quantization: str | None = None):
    try:
        with torch.device("meta"), InitSkipped():
            model = cls(config)
    except AttributeError as exc:
        raise CheckpointError(f"{folder}/config.json lacks a field {cls.__name__} needs: {exc}") from exc
    except ValueError as exc:                                  # a config feature Tandem does not implement
        raise CheckpointError(f"{folder}: {exc}") from exc
    checkpoint = Checkpoint(folder)
    names = tandem_names(checkpoint.names, cls)                 # tandem name -> checkpoint name(s)
    absent_optional = {n for n in getattr(model, "optional_weights", ()) if n not in names}
    if absent_optional:
        model.drop_weights(absent_optional)
    expected = model.state_dict()                              # meta tensors: names, shapes, dtypes
    ignored = set(getattr(model, "ignored_weights", ()))
    check_names_and_shapes(folder, checkpoint, names, expected, ignored)
    state = {}
    for name, want in expected.items():
        tensor = read_tensor(checkpoint, names[name])
        target_dtype = dtype if want.dtype.is_floating_point else want.dtype
        # a copy of its own: a tensor of the file's dtype would otherwise be the file's mapping, which every
        # such tensor kept whole in the process's memory beside the packed weights
        state[name] = tensor.to(device=device, dtype=target_dtype, copy=True)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)                                           # non-persistent buffers (rotary inv_freq)
    model.requires_grad_(False)
    stack_projections(model)
    quantize(model, quantization)
    model.kernels = load_cpu_kernels(cpu_kernels) if torch.device(device).type == "cpu" else None
    return model.eval()


def finish(model, quantization: str | None) -> None:
    """A built model's last steps, once its LM head is known (a draft head's is its target's): the head
    quantized, the weights packed for the native kernels where the model runs them."""
    quantize_lm_head(model, quantization)
    use_cpu_kernels(model, model.kernels)
    if model.kernels is not None:
        return_free_memory()              # the loaded, stacked and unpacked copies' pages


def tandem_names(checkpoint_names: list[str], cls: type) -> dict[str, str | dict]:
    """Tandem name -> checkpoint name, or for stacked experts -> {(expert, proj): checkpoint name}."""
    renames = getattr(cls, "checkpoint_renames", ())
    mapped: dict[str, str | dict] = {}
    for original in checkpoint_names:
        name = original.removeprefix("model.")
        for old, new in renames:
            name = name.replace(old, new)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        expert = EXPERT_NAME.match(name)
        if expert is None:
            mapped[name] = original
            continue
        prefix, proj = expert["prefix"], expert["proj"]
        stacked = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
        mapped.setdefault(stacked, {})[(int(expert["expert"]), proj)] = original
    return mapped


def expert_parts(stacked_name: str, want: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Per-expert projections that make up a stacked tensor, with the shape each must have."""
    if stacked_name.endswith("gate_up_proj"):
        half = (want.shape[1] // 2, want.shape[2])
        return {"gate_proj": half, "up_proj": half}
    return {"down_proj": tuple(want.shape[1:])}


def check_names_and_shapes(folder: Path, checkpoint: "Checkpoint", names: dict, expected: dict,
                           ignored: set[str]) -> None:
    problems: list[str] = []
    prefix = "model." if any(n.startswith("model.") for n in checkpoint.names) else ""
    missing = [n for n in expected if n not in names]
    unexpected = [original for n, source in names.items() if n not in expected and n not in ignored
                  for original in ([source] if isinstance(source, str) else source.values())]
    for name, want in expected.items():
        source = names.get(name)
        if isinstance(source, str):
            shape = checkpoint.shape(source)
            if shape != tuple(want.shape):
                problems.append(f"tensor {source!r} has shape {list(shape)}, model expects {list(want.shape)}")
        elif isinstance(source, dict):
            check_experts(checkpoint, name, want, source, problems, missing)
            unexpected += [original for (expert, _), original in source.items() if expert >= want.shape[0]]
    if missing:
        problems.append("missing tensors: " + listing([n if n.startswith("lm_head") else prefix + n for n in missing]))
    if unexpected:
        problems.append("unexpected tensors: " + listing(unexpected))
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit the model: " + "; ".join(problems))


def check_experts(checkpoint: "Checkpoint", name: str, want: torch.Tensor, source: dict,
                  problems: list[str], missing: list[str]) -> None:
    """A stacked expert tensor: every expert's projections present, with the shape each must have."""
    parts = expert_parts(name, want)
    for expert in range(want.shape[0]):
        for proj, part_shape in parts.items():
            part = source.get((expert, proj))
            if part is None:
                missing.append(f"{name.rsplit('.', 1)[0]}.{expert}.{proj}.weight")
            elif checkpoint.shape(part) != part_shape:
                problems.append(f"tensor {part!r} has shape {list(checkpoint.shape(part))}, "
                                f"model expects {list(part_shape)}")


def listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:MAX_NAMES_IN_ERROR])
    more = len(names) - MAX_NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


def read_tensor(checkpoint: "Checkpoint", source: str | dict) -> torch.Tensor:
    if isinstance(source, str):
        return checkpoint.tensor(source)
    experts = 1 + max(expert for expert, _ in source)
    if (0, "down_proj") in source:
        return torch.stack([checkpoint.tensor(source[(e, "down_proj")]) for e in range(experts)])
    return torch.stack([torch.cat([checkpoint.tensor(source[(e, "gate_proj")]),
                                   checkpoint.tensor(source[(e, "up_proj")])]) for e in range(experts)])


# ---------------------------------------------------------------------------- files

class Checkpoint:
    """The tensors of a folder's safetensors files: model.safetensors, the shards named by
    model.safetensors.index.json, or else every *.safetensors file."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors weights in {folder} "
                                  "(expected model.safetensors or model.safetensors.index.json)")
        self.handles = {}
        self.file_of: dict[str, str] = {}
        for file in files:
            if not (folder / file).is_file():
                raise CheckpointError(f"checkpoint shard {file} listed in {index.name} is missing from {folder}")
            handle = safe_open(folder / file, framework="pt", device="cpu")
            self.handles[file] = handle
            for name in handle.keys():
                if name in self.file_of:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.file_of[name]} and {file}")
                self.file_of[name] = file
        self.names = list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.file_of[name]].get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self.handles[self.file_of[name]].get_tensor(name)
