"""Corpus and tokenizer for the embedded tiny models.

The corpus is this Python's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, site-packages excluded). Files are split
deterministically by a hash of their relative path: ~2% go to a held-out set
that no training stage ever reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from pathlib import Path

import torch

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096
HELDOUT_MOD = 50  # 1 file in 50 (~2%) is held out

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Deterministic ~2% held-out split keyed on the file's relative path."""
    digest = hashlib.sha256(relpath.encode()).hexdigest()
    return int(digest[:8], 16) % HELDOUT_MOD == 0


def load_files() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train, heldout) lists of (relative path, text), sorted by path."""
    root = stdlib_root()
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "dist-packages" in rel.split("/"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        (heldout if is_heldout(rel) else train).append((rel, text))
    return train, heldout


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Train a byte-level BPE (vocab 4096) and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=SPECIALS[1:],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    save_tokenizer(fast, out_dir)


def save_tokenizer(tok, folder: Path) -> None:
    """save_pretrained, then rewrite tokenizer_config.json in the portable
    PreTrainedTokenizerFast form (chat_template inline, additional_special_tokens)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    finalize_tokenizer_files(folder)


def finalize_tokenizer_files(folder: Path) -> None:
    """Make a saved tokenizer folder loadable by transformers 4.x and 5.x alike."""
    p = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    for key in ("backend", "is_local", "local_files_only", "extra_special_tokens"):
        cfg.pop(key, None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", additional_special_tokens=SPECIALS[1:],
               chat_template=CHAT_TEMPLATE, add_bos_token=False, add_eos_token=False)
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    jinja = Path(folder) / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "additional_special_tokens": SPECIALS[1:]}
    (Path(folder) / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(folder: Path):
    """Load the saved tokenizer through AutoTokenizer (as users will)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Encode documents into one stream: EOS doc EOS doc ... (int16)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int16)


def build(cache: Path, tok_dir: Path) -> dict:
    """Stage 'tokenizer': split, train the tokenizer, cache encoded streams."""
    train, heldout = load_files()
    train_tokenizer([t for _, t in train], tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    cache.mkdir(parents=True, exist_ok=True)
    stats = {"stdlib": str(stdlib_root())}
    for name, files in (("train", train), ("heldout", heldout)):
        stream = encode_stream(tokenizer, [t for _, t in files])
        torch.save(stream, cache / f"{name}_ids.pt")
        stats[f"{name}_files"] = len(files)
        stats[f"{name}_bytes"] = sum(len(t.encode()) for _, t in files)
        stats[f"{name}_tokens"] = int(stream.numel())
    (cache / "heldout_files.json").write_text(json.dumps([p for p, _ in heldout], indent=0))
    return stats


def load_stream(cache: Path, name: str) -> torch.Tensor:
    """Load a cached token stream as int64."""
    return torch.load(cache / f"{name}_ids.pt").long()


def heldout_texts() -> list[tuple[str, str]]:
    """Held-out (path, text) pairs, recomputed from the split rule."""
    return load_files()[1]


def lr_at(base: float, step: int, progress: float, warmup: int) -> float:
    """Linear warmup, then cosine from base to base/10 over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / warmup)
    return base * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def optimizer_step(params, opt: torch.optim.Optimizer) -> None:
    """Clip the gradient norm to 1, step, and clear the gradients (every training loop here)."""
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def batches(stream: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless random windows of ``seq`` tokens from a token stream."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, stream.numel() - seq, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq] for s in starts.tolist()])


if __name__ == "__main__":  # quick look at the split
    tr, ho = load_files()
    print(len(tr), "train files,", len(ho), "held-out files;", os.fspath(stdlib_root()))
