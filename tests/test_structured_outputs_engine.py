"""Structured outputs on the embedded model, in-process: constrained greedy decoding equals plain
constrained decoding (one step a launch, no overlap) for every speculative algorithm, overlap on and
off, multi-step launches, CPU graphs and a KV pool small enough to retract requests, with unconstrained
requests in the same batches unchanged;
plain constrained decoding is transformers' greedy decoding under xgrammar's masks; every output,
greedy or seeded, matches its grammar and ends with it."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from devices.cpu import CpuDevice
from engine.args import parse_args
from engine.grammar import Grammar, GrammarCompiler
from engine.messages import SamplingParams
from engine.rank import build_core
from tests.e2e_prompts import CODE_PROMPTS
from tests.engine_harness import ALGORITHMS
from tests.grammars import GRAMMARS, problem
from tests.server_harness import DENSE

MAX_NEW = 64
BASE = ["--model-path", str(DENSE), "--max-running-requests", "4", "--chunked-prefill-size", "16",
        "--dtype", "float32"]
PLAIN = ALGORITHMS["none"] + ["--disable-overlap-schedule", "--num-scheduler-steps", "1"]
CASES = {
    "none": ALGORITHMS["none"],
    "none-4-steps": ALGORITHMS["none"] + ["--num-scheduler-steps", "4"],
    "none-graphs": ALGORITHMS["none"] + ["--enable-cpu-graph"],
    "eagle": ALGORITHMS["eagle"],
    "eagle-no-overlap": ALGORITHMS["eagle"] + ["--disable-overlap-schedule", "--num-scheduler-steps", "1"],
    "eagle-graphs-4-steps": ALGORITHMS["eagle"] + ["--enable-cpu-graph", "--num-scheduler-steps", "4"],
    "eagle3": ALGORITHMS["eagle3"] + ["--num-scheduler-steps", "4"],
    "standalone": ALGORITHMS["standalone"],
    "ngram": ALGORITHMS["ngram"],
    "eagle-retracting": ALGORITHMS["eagle"] + ["--max-total-tokens", "160"],    # requests retracted, recomputed
    "none-retracting": ALGORITHMS["none"] + ["--max-total-tokens", "160"],
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DENSE)


@pytest.fixture(scope="module")
def jobs(tokenizer):
    """(prompt, grammar name or None) per request: each grammar after two prompts, and two free requests."""
    prompts = [tokenizer.encode(CODE_PROMPTS[i]) for i in (0, 5)]
    return [(prompt, name) for name in GRAMMARS for prompt in prompts] + [(prompts[0], None), (prompts[1], None)]


def run_engine(flags: list[str], jobs, tokenizer, params: SamplingParams) -> list[tuple[list[int], str]]:
    """Each job's output tokens and finish reason, all submitted at once (four run at a time)."""
    eos = frozenset({tokenizer.eos_token_id})
    core = build_core(parse_args(BASE + flags), CpuDevice(), eos_ids=eos)
    compiler = GrammarCompiler(str(DENSE), core.runner.vocab_size, eos)
    requests = []
    for i, (prompt, name) in enumerate(jobs):
        spec = GRAMMARS[name] if name else None
        grammar = Grammar(compiler.compile_now(spec)) if spec else None
        job_params = msgspec.structs.replace(params, grammar=spec)
        assert core.scheduler.add(f"r{i}", prompt, job_params, grammar=grammar) is None
        requests.append(core.scheduler.requests[f"r{i}"])

    async def drive():
        for _ in range(20000):
            if not core.busy:
                return
            await core.step()
        raise AssertionError("the engine did not finish")
    asyncio.run(drive())
    core.runner.device.synchronize()
    assert ("--max-total-tokens" in flags) == (core.scheduler.retractions > 0)
    assert core.scheduler.pool.used_slots == 0
    return [(r.output_ids, r.finish_reason) for r in requests]


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def check_grammars(jobs, outputs, tokenizer) -> None:
    for (_, name), (ids, reason) in zip(jobs, outputs):
        if name is None or name == "json-object":
            continue                  # free text, or free strings: the toy model runs past any budget
        text = text_of(tokenizer, ids)
        assert reason == "stop", (name, text)                 # the grammar's end ends the request
        assert problem(name, text) is None, problem(name, text)


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def reference(jobs, tokenizer):
    outputs = run_engine(PLAIN, jobs, tokenizer, GREEDY)
    check_grammars(jobs, outputs, tokenizer)
    return outputs


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_greedy_equals_plain_constrained_decoding(case, jobs, tokenizer, reference):
    outputs = run_engine(CASES[case], jobs, tokenizer, GREEDY)
    for job, got, want in zip(jobs, outputs, reference):
        assert got == want, (case, job[1], text_of(tokenizer, got[0]), text_of(tokenizer, want[0]))


def test_free_requests_beside_constrained_ones_are_unchanged(jobs, tokenizer, reference):
    free_jobs = [(prompt, None) for prompt, _ in jobs]
    alone = run_engine(PLAIN, free_jobs, tokenizer, GREEDY)
    assert [out for out, (_, name) in zip(reference, jobs) if name is None] == alone[-2:]


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DENSE, torch_dtype=torch.float32).eval()


def transformers_constrained_greedy(model, prompt: list[int], name: str, tokenizer) -> list[int]:
    """Greedy decoding with transformers' logits (its own KV cache), masked by a fresh xgrammar matcher."""
    import torch
    import xgrammar as xgr
    compiled = GrammarCompiler(str(DENSE), model.config.vocab_size, frozenset({tokenizer.eos_token_id})) \
        .compile_now(GRAMMARS[name])
    matcher, out, past = xgr.GrammarMatcher(compiled), [], None
    bitmask, feed = xgr.allocate_token_bitmask(1, model.config.vocab_size), torch.tensor([prompt])
    with torch.no_grad():
        while len(out) < MAX_NEW and not matcher.is_terminated():
            step = model(feed, past_key_values=past, use_cache=True)
            logits, past = step.logits[:, -1].float(), step.past_key_values
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            feed = torch.tensor([[token]])
    return out


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["nested", "regex"])
def test_plain_constrained_decoding_is_transformers_greedy_under_the_same_masks(name, jobs, tokenizer, reference,
                                                                              hf_model):
    index = next(i for i, job in enumerate(jobs) if job[1] == name)
    assert reference[index][0] == transformers_constrained_greedy(hf_model, jobs[index][0], name, tokenizer)


@pytest.mark.parametrize("case", ["none", "eagle", "ngram"])
def test_seeded_sampling_under_a_grammar_matches_it(case, jobs, tokenizer):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=11)
    outputs = run_engine(CASES[case], jobs, tokenizer, params)
    check_grammars(jobs, outputs, tokenizer)
    again = run_engine(CASES[case], jobs, tokenizer, params)
    assert again == outputs                                   # seeded: the same output every time
