"""Model cards (README.md) for the embedded tiny models, rendered from stage stats."""

from __future__ import annotations

import platform
from pathlib import Path

REPRO = "python tools/train_tiny.py --out models"
EVAL = "python tools/eval_acceptance.py --models models --json out/acceptance.json"


def _machine() -> str:
    import os

    return f"{os.cpu_count()}-core {platform.machine()} CPU (shared, no GPU), torch bf16 autocast"


def _data(s: dict) -> str:
    t = s.get("tokenizer", {})
    return (
        "## Data\n\n"
        f"Python standard library sources (`*.py` under `sysconfig.get_paths()['stdlib']`, here `{t.get('stdlib')}`; "
        "site-packages excluded). Split by file: a file is held out when "
        "`int(sha256(relative_path)[:8], 16) % 50 == 0` (~2%); training never reads held-out files.\n\n"
        "| split | files | bytes | tokens |\n|---|---|---|---|\n"
        f"| train | {t.get('train_files')} | {t.get('train_bytes')} | {t.get('train_tokens')} |\n"
        f"| held-out | {t.get('heldout_files')} | {t.get('heldout_bytes')} | {t.get('heldout_tokens')} |\n\n"
        "Documents are concatenated as `<|endoftext|> doc <|endoftext|> doc ...`; training samples are random "
        "windows of that stream.\n"
    )


TOKENIZER = (
    "## Tokenizer\n\n"
    "Byte-level BPE (Hugging Face `tokenizers`), vocab 4096, trained on the train split. Special tokens: "
    "`<|endoftext|>` (id 0: EOS, BOS-like document separator, pad), `<|im_start|>` (1), `<|im_end|>` (2). "
    "No BOS is added automatically. `tokenizer_config.json` holds a ChatML `chat_template` "
    "(`<|im_start|>role\\ncontent<|im_end|>\\n`...; `add_generation_prompt` appends `<|im_start|>assistant\\n`). "
    "Decoding round-trips text.\n"
)


def _accept_table(acc: dict, names: list[str]) -> str:
    rows = [(n, acc.get("heads", {}).get(n)) for n in names]
    rows = [(n, r) for n, r in rows if r]
    if not rows:
        return "(acceptance not measured yet)\n"
    out = ["| head | k=1 | k=3 | k=5 | draft step / target step |", "|---|---|---|---|---|"]
    for n, r in rows:
        a = r["accept"]
        out.append(f"| {n} | {a.get('1', '-')} | {a.get('3', '-')} | {a.get('5', '-')} | "
                   f"{r['draft_target_cost_ratio']} ({r['draft_step_ms']} ms / {r['target_step_ms']} ms) |")
    return (
        "\n".join(out) + "\n\n"
        f"Mean accepted tokens per verify step (bonus token included), greedy chain drafting of k tokens, "
        f"{acc.get('n_prompts')} held-out prompts of {acc.get('prompt_len')} tokens, ~{acc.get('gen_len')} "
        "generated tokens each. Step cost: median of batch-1 decode steps with a KV cache "
        "(transformers target vs the reference head in `tools/tiny_heads.py`), same machine.\n"
    )


def target_card(name: str, s: dict, arch: str, arch_text: str, heads: list[str]) -> str:
    st = s.get(name.split("-")[1], {})
    samples = "\n".join(
        f"Prompt:\n```python\n{x['prompt']}\n```\nGreedy continuation (64 new tokens, starting right after the "
        f"prompt's last character):\n```python\n{x['completion']}\n```\n"
        for x in st.get("samples", []))
    return f"""# {name}

A tiny `{arch}` trained from scratch on Python source, embedded in Tandem for tests, demos and
speculative-decoding experiments. Loads with `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained` from this folder alone. Weights are bf16 (`model.safetensors`).
It writes Python-looking code; it is not a useful assistant.

## Architecture

{arch_text}

{_data(s)}
{TOKENIZER}
## Training

- seed {st.get('seed')}, AdamW (betas 0.9/0.95, weight decay 0.1), peak lr {st.get('lr')}, linear warmup
  then cosine to lr/10 (progress = max(step/max_steps, elapsed/time budget)), grad clip 1.0
- batch {st.get('batch')} x {st.get('seq')} tokens, bf16 autocast on CPU, fp32 master weights
- steps {st.get('steps')}, tokens seen {st.get('tokens_seen')}, training time {st.get('train_seconds')} s
  ({st.get('tokens_per_second')} tokens/s) on a {_machine()}
- parameters {st.get('params')}

## Evaluation

Held-out loss {st.get('heldout_loss')} nats/token, **perplexity {st.get('heldout_ppl')}**
(fp32 forward of the saved bf16 weights, non-overlapping {st.get('seq')}-token windows,
{st.get('heldout_eval_tokens')} held-out tokens). A uniform model has perplexity 4096.

### Greedy samples

{samples}
### Draft heads for this model

{_accept_table(s.get('acceptance', {}), heads)}
## Reproduce

```
{REPRO}            # everything
# only this model (needs the tokenizer stage's cache)
python tools/train_tiny.py --out models --stages {name.split('-')[1]}
```
This checkpoint was produced by `{st.get('command', REPRO)}`.
Time-budgeted stages stop at `--minutes-*` or `--steps-*`, whichever comes first, so step counts
depend on machine speed.
"""


def head_card(name: str, s: dict, stage: str, arch_text: str) -> str:
    st = s.get(stage, {})
    extra = ""
    if "draft_vocab_size" in st:
        extra = (f"- draft vocab {st['draft_vocab_size']}: most frequent target argmax next tokens on training "
                 f"windows; they cover {st['draft_vocab_argmax_coverage']} of target argmax tokens there\n")
    return f"""# {name}

Draft head for speculative decoding with `{st.get('target')}` (same tokenizer; embeddings
{'and LM head ' if 'eagle3' not in name else ''}shared from the target at load time, not stored here).

## Layout and forward

{arch_text}

## Training

- frozen target, features computed on the fly (bf16 autocast) for random training windows
  of the train split; seed {st.get('seed')}
- HASS-style unroll of {st.get('unroll')} steps: step j+1 feeds the head's own step-j output at
  position t-1 in place of the target feature (step weights 1.0 / 0.8 / 0.6)
{extra}- AdamW lr {st.get('lr')} warmup + cosine, batch {st.get('batch')}, {st.get('steps')} steps,
  {st.get('positions_seen')} positions, {st.get('train_seconds')} s ({st.get('tokens_per_second')} positions/s)
  on a {_machine()}
- final top-1 agreement with the target per unroll step (training EMA): {st.get('final_top1_agreement_per_step')}

## Acceptance

{_accept_table(s.get('acceptance', {}), [name])}
## Reproduce

```
{REPRO} --stages {stage},eval,cards
{EVAL}
```
This checkpoint was produced by `{st.get('command', REPRO)}`.
"""


def draft_card(name: str, s: dict) -> str:
    st = s.get("draft-dense", {})
    return f"""# {name}

A small stand-alone draft model for `{st.get('target')}`: `--speculative-algorithm standalone`
uses it by default when Tandem serves the embedded dense model. Same tokenizer, same
`LlamaForCausalLM` layout as the target with {st.get('layers')} decoder layers (hidden 256, tied
embeddings, {st.get('params')} parameters, bf16 `model.safetensors`); it loads with
`AutoModelForCausalLM.from_pretrained` from this folder alone.

## Training

- initialised from the target's embeddings, first {st.get('layers')} decoder layers and final norm
- distilled: soft cross-entropy against the frozen target's next-token distribution on random
  windows of the train split (bf16 autocast), seed {st.get('seed')}
- AdamW lr {st.get('lr')} warmup + cosine, batch {st.get('batch')} x {st.get('seq')}, {st.get('steps')} steps,
  {st.get('tokens_seen')} tokens, {st.get('train_seconds')} s on a {_machine()}
- final distillation loss {st.get('final_distill_loss')}

## Evaluation

Top-1 agreement with the target on held-out windows (fp32, the saved bf16 weights):
**{st.get('heldout_top1_agreement')}**. Acceptance inside the server is reported by
`bench/compare.py` (accept len column) and in the main README.

## Reproduce

```
{REPRO} --stages draft-dense,cards
```
This checkpoint was produced by `{st.get('command', REPRO)}`.
"""


EAGLE_TEXT = """SGLang `LlamaForCausalLMEagle` layout (`config.json`: Llama config, `num_hidden_layers: 1`).
Weights (no `model.` prefix): `fc.weight` [H, 2H], `fc.bias` [H],
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`. Layer 0 has no input_layernorm; no embed_tokens,
lm_head or final norm in the file.

At position t: `x = fc(cat([embed(token_{t+1}), f_t]))` where `f_t` is the target's final-normed hidden
state at t (what its LM head reads); one Llama decoder layer (causal attention over the draft
sequence, RoPE at position t, no input norm): `h = x + attn(x); g = h + mlp(post_attention_layernorm(h))`.
`logits = target.lm_head(g)` predict token_{t+2}; `g` (no final norm) is the feature input of the
next chain step. Trained with SmoothL1(g_t, f_{t+1}) + 0.5 * soft CE against the target's
next-token distribution, gaussian noise (5% of RMS) on f. Reference module: `tools/tiny_heads.py::EagleHead`."""

EAGLE3_TEXT = """SGLang `LlamaForCausalLMEagle3` layout (`config.json`: Llama config, `num_hidden_layers: 1`,
`draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 5]`).

**Captured target states** (SGLang convention): id i means the *output* of target decoder layer i
(0-indexed), i.e. the residual stream *entering* layer i+1 = transformers `hidden_states[i+1]`.
So aux = the residual streams entering layers 2, 4 and 6 of the 8-layer target, concatenated in that order.

Weights: `fc.weight` [H, 3H] (no bias), `midlayer.input_layernorm.weight`, `midlayer.hidden_norm.weight`,
`midlayer.self_attn.q_proj.weight` [heads*hd, 2H], `k_proj`/`v_proj` [kv*hd, 2H], `o_proj` [H, heads*hd],
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.post_attention_layernorm.weight`, `norm.weight`,
`lm_head.weight` [draft_vocab, H], `d2t` [draft_vocab] int64 (target_id = draft_id + d2t[draft_id]),
`t2d` [vocab] bool. Embeddings are shared from the target.

Forward: first step `h = fc(cat(aux))`, later steps h = previous output; `residual = h`;
`x = cat([input_layernorm(embed(token_{t+1})), hidden_norm(h)])`; `h = residual + attn(x)` (2H -> H,
RoPE at t); `h = h + mlp(post_attention_layernorm(h))`; output h is fed back; `logits = lm_head(norm(h))`
over the draft vocab. Trained with soft CE against the target's next-token distribution restricted
to the draft vocab. Reference module: `tools/tiny_heads.py::Eagle3Head`."""

DENSE_TEXT = """`LlamaForCausalLM`: hidden 256, 8 layers, 4 attention heads (head_dim 64), 2 KV heads (GQA),
SwiGLU intermediate 768, vocab 4096, RoPE theta 10000, max_position_embeddings 2048,
RMSNorm eps 1e-5, tied input/output embeddings, bos = eos = pad = `<|endoftext|>` (0)."""

MOE_TEXT = """`Qwen3MoeForCausalLM`: hidden 256, 4 layers, 4 attention heads (head_dim 64, q/k RMSNorm), 2 KV heads,
8 experts per layer, top-2 routing (`norm_topk_prob: true`), `moe_intermediate_size` 256,
`decoder_sparse_step` 1, `mlp_only_layers` [], no shared expert, vocab 4096, RoPE theta 10000,
tied embeddings, router aux loss coefficient 0.01 during training. Experts are stored per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), router `model.layers.N.mlp.gate.weight`.
`config.json` carries both `num_experts` and `num_local_experts`."""


def write_all(models: Path, stats: dict) -> None:
    cards = {
        "tandem-dense": target_card("tandem-dense", stats, "LlamaForCausalLM", DENSE_TEXT,
                                    ["tandem-dense-eagle", "tandem-dense-eagle3"]),
        "tandem-moe": target_card("tandem-moe", stats, "Qwen3MoeForCausalLM", MOE_TEXT, ["tandem-moe-eagle"]),
        "tandem-dense-eagle": head_card("tandem-dense-eagle", stats, "eagle-dense", EAGLE_TEXT),
        "tandem-dense-eagle3": head_card("tandem-dense-eagle3", stats, "eagle3-dense", EAGLE3_TEXT),
        "tandem-moe-eagle": head_card("tandem-moe-eagle", stats, "eagle-moe", EAGLE_TEXT),
        "tandem-dense-draft": draft_card("tandem-dense-draft", stats),
    }
    for name, text in cards.items():
        if (models / name).is_dir():
            (models / name / "README.md").write_text(text)
