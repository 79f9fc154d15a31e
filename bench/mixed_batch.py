"""One forward of a batch that mixes decodes with a prompt chunk, with the attention padded to
the widest sequence (one part) and with decodes apart from chunks (`attention_groups`), side by
side in one process on the same weights and cache.

    python bench/mixed_batch.py --decodes 15 --context 300 --chunk 200

Prints the median time of each way (and of the two halves run alone) over --repeats forwards.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.args import DEFAULT_MODEL  # noqa: E402
from engine.models.attention import KVCache, attention_groups, build_attention_batch  # noqa: E402
from engine.models.loader import load_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=DEFAULT_MODEL)
    ap.add_argument("--decodes", type=int, default=15, help="Decoding sequences in the batch.")
    ap.add_argument("--context", type=int, default=300, help="Tokens each decode attends to.")
    ap.add_argument("--chunk", type=int, default=200, help="Tokens of the prompt chunk in the batch.")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model_path, torch.float32, "cpu")
    layers, kv_heads, head_dim = model.kv_layout()
    seqs = args.decodes + 1
    width = max(args.context, args.chunk)
    kv = KVCache.allocate(layers, seqs * width, kv_heads, head_dim, torch.float32)
    table = torch.arange(seqs * width).view(seqs, width)

    def forward(q_lens: list[int], kv_lens: list[int], grouped: bool) -> float:
        groups = attention_groups(q_lens, kv_lens, "cpu") if grouped else None
        batch = build_attention_batch(torch.tensor(q_lens), torch.tensor(kv_lens), torch.arange(len(q_lens)),
                                      table, max(q_lens), max(kv_lens), kv, groups=groups, tokens=sum(q_lens))
        ids = torch.randint(0, model.vocab_size, (sum(q_lens),))
        start = time.perf_counter()
        with torch.inference_mode():
            model(ids, batch)
        return time.perf_counter() - start

    mixed = ([args.chunk] + [1] * args.decodes, [args.chunk] + [args.context] * args.decodes)
    cases = {"mixed, one padded part": (*mixed, False), "mixed, decodes apart": (*mixed, True),
             "the chunk alone": ([args.chunk], [args.chunk], False),
             "the decodes alone": ([1] * args.decodes, [args.context] * args.decodes, False)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats + 2):                      # interleaved; the first two are warm-up
        for name, case in cases.items():
            times[name].append(forward(*case))
    print(f"{args.decodes} decodes (context {args.context}) + a {args.chunk}-token chunk, "
          f"{args.threads} threads, median of {args.repeats}:")
    for name, values in times.items():
        print(f"  {name:24s} {1e3 * statistics.median(values[2:]):8.2f} ms")


if __name__ == "__main__":
    main()
