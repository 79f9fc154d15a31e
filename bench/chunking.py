"""Do a prompt's answers depend on how its prefill is chunked? A request that reads a cached prefix
computes the rest of its prompt in other chunks than it would alone, so where they do, the prefix
cache changes answers (docs/prefix-cache.md: "Determinism").

    python bench/chunking.py --dtype bfloat16 --speculative-algorithm none --sampling greedy
    python bench/chunking.py --dtype float32 --speculative-algorithm eagle --sampling seeded

Serves --num-prompts prompts (bench/serving.py's code dataset) one at a time on the embedded model,
in-process and without the prefix cache, once per chunk size of --chunks (--chunked-prefill-size),
and counts the prompts whose answer differs from the first size's, with
the largest change of the first token's logprob. Flags it does not know go to the engine
(engine/args.py). Prints one JSON line (appended to --output-file too).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

if __package__ in (None, ""):           # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serving
from devices.cpu import CpuDevice
from engine.args import parse_args as engine_args
from engine.messages import SamplingParams
from engine.rank import build_core

MODEL = serving.DEFAULT_TOKENIZER       # the embedded model's folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy",
                        help="seeded: temperature 0.8, top-p 0.95, seeds 1-3.")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chunks", default="2048,16,7", help="Chunk sizes, the first the reference.")
    parser.add_argument("--prompt-len", type=int, default=128, help="Most prompt tokens (half of it at least).")
    parser.add_argument("--seed", type=int, default=5, help="Which sources the prompts are cut from.")
    parser.add_argument("--output-file", default=None)
    return parser


def prompts(args) -> list[list[int]]:
    tokenizer = serving.load_tokenizer(MODEL)
    dataset = argparse.Namespace(seed=args.seed, num_prompts=args.num_prompts, random_input_len=args.prompt_len,
                                 random_range_ratio=0.5, random_output_len=1, dataset_path=None)
    return [tokenizer.encode(request.prompt) for request in serving.code_requests(dataset, tokenizer)]


def params(args, i: int) -> SamplingParams:
    if args.sampling == "greedy":
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, ignore_eos=True, logprobs=0)
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95, seed=1 + i % 3,
                          ignore_eos=True, logprobs=0)


def answers(args, engine_flags: list[str], chunk: int, prompt_ids: list[list[int]]) -> list[tuple[list, list]]:
    """Each prompt's output ids and logprobs, served alone."""
    flags = ["--model-path", str(MODEL), *engine_flags, "--chunked-prefill-size", str(chunk), "--disable-radix-cache"]
    core = build_core(engine_args(flags), CpuDevice(), eos_ids=frozenset())

    async def serve():
        done = []
        for i, ids in enumerate(prompt_ids):
            assert core.scheduler.add(f"p{i}", ids, params(args, i)) is None
            request = core.scheduler.requests[f"p{i}"]
            while core.busy:
                await core.step()
            done.append((request.output_ids, request.output_logprobs))
        return done
    return asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    args, engine_flags = build_parser().parse_known_args(argv)
    prompt_ids = prompts(args)
    chunks = [int(size) for size in args.chunks.split(",")]
    reference = answers(args, engine_flags, chunks[0], prompt_ids)
    result = {"engine_flags": engine_flags, "sampling": args.sampling, "prompts": len(prompt_ids),
              "reference_chunk": chunks[0], "chunks": {}}
    for chunk in chunks[1:]:
        other = answers(args, engine_flags, chunk, prompt_ids)
        result["chunks"][chunk] = {
            "answers_differ": sum(a[0] != b[0] for a, b in zip(reference, other)),
            "max_first_logprob_change": max(abs(a[1][0] - b[1][0]) for a, b in zip(reference, other))}
    line = json.dumps(result)
    print(line)
    if args.output_file:
        with open(args.output_file, "a") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
