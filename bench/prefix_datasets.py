"""Workloads that share prefixes, for the radix prefix cache (bench/serving.py's --dataset-name):

  generated-shared-prefix  SGLang's: --gsp-num-groups groups, each a system prompt of
                           --gsp-system-prompt-len tokens, and --gsp-prompts-per-group questions of
                           --gsp-question-len tokens asked after it; --gsp-output-len tokens out;
                           the requests shuffled (--num-prompts is ignored: groups x questions)
  multi-turn               --num-prompts conversations of --multi-turn-turns turns: each turn sends
                           the whole conversation so far (every earlier prompt and answer) and a new
                           question of --multi-turn-question-len tokens, as chat clients do

Texts are random tokens decoded (as the random dataset makes them), so that no cache outside the
workload's own sharing can hit.
"""
from __future__ import annotations

import argparse
import random


def random_text(rng: random.Random, tokenizer, vocab: list[int], length: int) -> str:
    return tokenizer.decode([rng.choice(vocab) for _ in range(length)])


def text_vocab(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size)
            if i not in special and "\ufffd" not in tokenizer.decode([i]) and tokenizer.decode([i]).strip()]


def shared_prefix_requests(args, tokenizer, make_request) -> list:
    """Groups of questions after one system prompt each, shuffled."""
    rng, vocab = random.Random(args.seed), text_vocab(tokenizer)
    requests = []
    for _ in range(args.gsp_num_groups):
        system = random_text(rng, tokenizer, vocab, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            question = random_text(rng, tokenizer, vocab, args.gsp_question_len)
            requests.append(make_request(system + "\n" + question, args.gsp_output_len))
    rng.shuffle(requests)
    return requests


def multi_turn_requests(args, tokenizer, make_request) -> list:
    """One request per conversation: its first question, and the questions of its later turns (each sent
    after the answer before it, with the conversation so far: bench/serving.py's send_conversation)."""
    rng, vocab = random.Random(args.seed), text_vocab(tokenizer)
    requests = []
    for _ in range(args.num_prompts):
        first = make_request(random_text(rng, tokenizer, vocab, args.multi_turn_question_len), args.random_output_len)
        first.turns = [("\n" + random_text(rng, tokenizer, vocab, args.multi_turn_question_len), args.random_output_len)
                       for _ in range(args.multi_turn_turns - 1)]
        requests.append(first)
    return requests


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gsp-num-groups", type=int, default=8, help="generated-shared-prefix: system prompts.")
    parser.add_argument("--gsp-prompts-per-group", type=int, default=8,
                        help="generated-shared-prefix: questions after each system prompt.")
    parser.add_argument("--gsp-system-prompt-len", type=int, default=512,
                        help="generated-shared-prefix: tokens of a system prompt.")
    parser.add_argument("--gsp-question-len", type=int, default=32,
                        help="generated-shared-prefix: tokens of a question.")
    parser.add_argument("--gsp-output-len", type=int, default=32, help="generated-shared-prefix: output tokens.")
    parser.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: turns a conversation.")
    parser.add_argument("--multi-turn-question-len", type=int, default=48,
                        help="multi-turn: tokens of each turn's new question.")
