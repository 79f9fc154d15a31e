"""Reference torch modules for the EAGLE draft heads (SGLang checkpoint layouts).

* ``EagleHead``  - ``LlamaForCausalLMEagle``: ``g = layer(fc(cat(embed(tok_{t+1}), f_t)))``
  with no input norm and no final norm; logits = target ``lm_head(g)``.
* ``Eagle3Head`` - ``LlamaForCausalLMEagle3``: first step ``h = fc(cat(aux))``;
  ``x = cat(input_layernorm(embed(tok)), hidden_norm(h))`` -> attention (2H -> H)
  -> MLP; output ``h`` (fed back), logits = ``lm_head(norm(h))`` over the draft vocab.

Both share ``embed_tokens`` (and EAGLE also ``lm_head``) with the target model.
They are plain full-sequence modules with an optional tiny KV cache, and are
the independent reference for the serving engine's draft implementations.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (rotate-half) rotary embedding; x [B, heads, T, hd], pos [B, T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = pos.float()[..., None] * inv  # [B, T, hd/2]
    emb = torch.cat([ang, ang], -1)[:, None]  # [B, 1, T, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    """GQA self-attention with RoPE; input width may differ from hidden (EAGLE-3)."""

    def __init__(self, cfg: dict, in_dim: int):
        super().__init__()
        h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.theta = float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, pos, self.theta), apply_rope(k, pos, self.theta)
        past = 0
        if cache is not None:
            if "k" in cache:
                past = cache["k"].shape[2]
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = k.shape[2]
            mask = torch.arange(s, device=x.device)[None] <= (past + torch.arange(t, device=x.device))[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """Llama decoder layer without input_layernorm (EAGLE layer 0)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.self_attn = Attention(cfg, cfg["hidden_size"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, pos, cache=None):
        h = x + self.self_attn(x, pos, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _positions(b: int, t: int, start, device) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start
    return torch.arange(start, start + t, device=device)[None].expand(b, t)


def _target_parts(target):
    """(embed_tokens, lm_head) modules of a transformers causal LM."""
    return target.get_input_embeddings(), target.get_output_embeddings()


def _load_folder(folder):
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    return cfg, load_file(str(folder / "model.safetensors"))


def _save_folder(module: nn.Module, cfg: dict, folder, dtype=torch.bfloat16) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in module.state_dict().items():
        v = v.detach().cpu()
        sd[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


class EagleHead(nn.Module):
    """EAGLE(-1/2) head in SGLang's ``LlamaForCausalLMEagle`` layout."""

    def __init__(self, cfg: dict, target=None):
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self._shared = _target_parts(target) if target is not None else None

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, pos=0, cache: dict | None = None):
        """ids [B,T]: token t+1; feats [B,T,H]: target feature f_t (or a previous g).

        Returns g [B,T,H] (prediction of f_{t+1}); ``pos`` is a start offset or [B,T]."""
        embed = self._shared[0]
        x = self.fc(torch.cat([embed(ids).to(feats.dtype), feats], -1))
        return self.layers[0](x, _positions(*ids.shape, pos, ids.device), cache)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits via the target's lm_head."""
        return self._shared[1](g)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    @classmethod
    def from_pretrained(cls, folder, target, dtype=torch.float32):
        cfg, sd = _load_folder(folder)
        head = cls(cfg, target)
        head.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
        return head.to(dtype)

    def save_pretrained(self, folder) -> None:
        _save_folder(self, self.cfg, folder)


class Eagle3Midlayer(nn.Module):
    """EAGLE-3 decoder layer: attention over cat(norm(embed), norm(hidden))."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, 2 * h)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, emb, hidden, pos, cache=None):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
        h = hidden + self.self_attn(x, pos, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head in SGLang's ``LlamaForCausalLMEagle3`` layout."""

    def __init__(self, cfg: dict, target=None):
        super().__init__()
        h, n_aux = cfg["hidden_size"], len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.cfg = cfg
        self.fc = nn.Linear(n_aux * h, h, bias=False)
        self.midlayer = Eagle3Midlayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))
        self._shared = _target_parts(target) if target is not None else None

    @property
    def capture_layers(self) -> list[int]:
        """Target decoder layers whose INPUT residual stream is captured (SGLang: id + 1)."""
        return [i + 1 for i in self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,T,3H] (captured states concatenated in order) -> first-step hidden."""
        return self.fc(aux)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, pos=0, cache: dict | None = None):
        """ids [B,T]: token t+1; hidden [B,T,H]: fc(aux_t) or a previous output. Returns h."""
        emb = self._shared[0](ids).to(hidden.dtype)
        return self.midlayer(emb, hidden, _positions(*ids.shape, pos, ids.device), cache)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits."""
        return self.lm_head(self.norm(h))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @classmethod
    def from_pretrained(cls, folder, target, dtype=torch.float32):
        cfg, sd = _load_folder(folder)
        head = cls(cfg, target)
        head.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()})
        return head.to(dtype)

    def save_pretrained(self, folder) -> None:
        _save_folder(self, self.cfg, folder)


def load_head(folder, target, dtype=torch.float32):
    """Load either head type from its folder, attached to ``target``."""
    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    cls = Eagle3Head if arch == "LlamaForCausalLMEagle3" else EagleHead
    return cls.from_pretrained(folder, target, dtype)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, capture: list[int] = ()):
    """Run a transformers target; return (logits, f, aux).

    f is the final-normed hidden state the LM head reads; aux concatenates the
    residual streams entering each decoder layer listed in ``capture``."""
    grabbed: dict[int, torch.Tensor] = {}
    hooks = []
    for li in capture:
        def hook(_mod, args, kwargs, li=li):
            grabbed[li] = args[0] if args else kwargs["hidden_states"]
        hooks.append(target.model.layers[li].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        f = target.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for hk in hooks:
            hk.remove()
    aux = torch.cat([grabbed[li] for li in capture], -1) if capture else None
    return target.lm_head(f), f, aux
