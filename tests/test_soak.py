"""bench/soak.py: each answer check catches a crafted bad answer (and passes a good one), the
request mix, /proc helpers, the client against a tiny fake server, and one short soak
against a real server that must end with no violation and every KV slot free."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from bench import soak
from bench.soak_checks import Answer, Completion, Choice, Determinism, Plan, check_answer
from bench.soak_mix import BAD_REQUESTS, SHORT_PROMPTS, Mix, Prompt
from bench.soak_pages import PLACES
from bench.soak_server import RssSample, parse_gauges, pid_listening_on, rank_pids
from tests.server_harness import running_server


# ---- crafted answers ----------------------------------------------------------------------

def completion_chunk(text: str, finish: str | None = None, index: int = 0) -> str:
    choice = {"index": index, "text": text, "finish_reason": finish}
    return json.dumps({"object": "text_completion", "choices": [choice]})


def usage_chunk(prompt: int, completion: int, total: int | None = None) -> str:
    total = prompt + completion if total is None else total
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
    return json.dumps({"object": "text_completion", "choices": [], "usage": usage})


def stream_plan(**fields) -> Plan:
    return Plan(0, "completions", {}, **{"stream": True, "max_tokens": 4, "include_usage": True, **fields})


def stream_answer(*payloads: str) -> Answer:
    return Answer(status=200, events=list(payloads))


def whole_answer(body, status: int = 200) -> Answer:
    return Answer(status=status, body=body if isinstance(body, bytes) else json.dumps(body).encode())


def kinds(verdict) -> list[str]:
    return [kind for kind, _ in verdict.violations]


GOOD_STREAM = (completion_chunk("a b"), completion_chunk(" c d", "length"), usage_chunk(5, 4), "[DONE]")


def test_a_complete_stream_passes():
    verdict = check_answer(stream_plan(), stream_answer(*GOOD_STREAM))
    assert (verdict.outcome, verdict.violations) == ("ok", [])
    assert verdict.completion.choices[0].text == "a b c d"


def test_a_stream_cut_before_done_is_caught():
    verdict = check_answer(stream_plan(), stream_answer(*GOOD_STREAM[:-1]))
    assert kinds(verdict) == ["stream_incomplete"]


def test_an_event_that_is_not_json_is_caught():
    verdict = check_answer(stream_plan(), stream_answer(GOOD_STREAM[0], '{"choices": [', *GOOD_STREAM[1:]))
    assert "stream_bad_json" in kinds(verdict)


def test_usage_that_does_not_add_up_is_caught():
    verdict = check_answer(stream_plan(), stream_answer(*GOOD_STREAM[:2], usage_chunk(5, 4, total=10), "[DONE]"))
    assert kinds(verdict) == ["usage_mismatch"]


def test_a_missing_usage_chunk_is_caught_when_asked_for():
    assert kinds(check_answer(stream_plan(), stream_answer(*GOOD_STREAM[:2], "[DONE]"))) == ["usage_missing"]
    assert check_answer(stream_plan(include_usage=False), stream_answer(*GOOD_STREAM[:2], "[DONE]")).outcome == "ok"


def test_finish_length_before_max_tokens_is_caught():
    verdict = check_answer(stream_plan(), stream_answer(*GOOD_STREAM[:2], usage_chunk(5, 3), "[DONE]"))
    assert kinds(verdict) == ["finish_reason_wrong"]


def test_more_tokens_than_max_tokens_are_caught():
    plan = Plan(0, "generate", {}, max_tokens=3)
    assert kinds(check_answer(plan, whole_answer(generate_output([1, 2, 3, 4], 4, "stop")))) == ["over_max_tokens"]
    choices = [{"index": i, "text": "x", "finish_reason": "stop"} for i in range(2)]
    body = {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}
    assert kinds(check_answer(Plan(0, "completions", {}, max_tokens=4, n=2), whole_answer(body))) == ["over_max_tokens"]


def test_a_stopped_answer_that_breaks_its_grammar_is_caught():
    def answer(text: str, reason: str) -> Answer:
        return whole_answer(generate_output([1, 2], 2, reason, text))
    plan = Plan(0, "generate", {}, max_tokens=40, grammar="regex")
    assert kinds(check_answer(plan, answer("yes, 12!", "stop"))) == []
    assert kinds(check_answer(plan, answer("yes, 12", "stop"))) == ["grammar_mismatch"]
    schema = Plan(0, "generate", {}, max_tokens=40, grammar="json_schema")
    assert kinds(check_answer(schema, answer('{"ok": true, "level": 3, "tag": "red"}', "stop"))) == []
    wrong = answer('{"ok": true, "level": 30, "tag": "red"}', "stop")
    assert kinds(check_answer(schema, wrong)) == ["grammar_mismatch"]


def test_a_stop_string_in_the_text_is_caught():
    plan = stream_plan(stops=(" c",))
    chunks = (completion_chunk("a b"), completion_chunk(" c", "stop"), usage_chunk(5, 2), "[DONE]")
    assert kinds(check_answer(plan, stream_answer(*chunks))) == ["stop_in_text"]


def logprobs(tokens: list[str]) -> dict:
    return {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens), "top_logprobs": [{}] * len(tokens),
            "text_offset": list(range(len(tokens)))}


def test_completion_tokens_must_match_the_tokens_sent():
    body = {"choices": [{"index": 0, "text": "a b", "logprobs": logprobs(["a", " b"]), "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    verdict = check_answer(Plan(0, "completions", {}, max_tokens=8, logprobs=True), whole_answer(body))
    assert "token_count_mismatch" in kinds(verdict)
    body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert check_answer(Plan(0, "completions", {}, max_tokens=8, logprobs=True), whole_answer(body)).outcome == "ok"


def test_logprob_lists_of_different_lengths_are_caught():
    lp = logprobs(["a", " b"]) | {"text_offset": [0]}
    body = {"choices": [{"index": 0, "text": "a b", "logprobs": lp, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    verdict = check_answer(Plan(0, "completions", {}, max_tokens=8, logprobs=True), whole_answer(body))
    assert kinds(verdict) == ["logprobs_wrong"]


def test_n_choices_need_distinct_indexes():
    choice = {"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}
    body = {"choices": [choice, choice], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert kinds(check_answer(Plan(0, "chat", {}, max_tokens=8, n=2), whole_answer(body))) == ["choices_wrong"]


def generate_output(ids: list[int], completion_tokens: int, finish: str = "length", text: str | None = None) -> dict:
    meta = {"prompt_tokens": 4, "completion_tokens": completion_tokens, "finish_reason": {"type": finish}}
    return {"text": "x" * len(ids) if text is None else text, "output_ids": ids, "meta_info": meta}


def test_generate_counts_its_output_ids():
    plan = Plan(0, "generate", {}, max_tokens=3)
    assert check_answer(plan, whole_answer(generate_output([1, 2, 3], 3))).outcome == "ok"
    assert kinds(check_answer(plan, whole_answer(generate_output([1, 2], 3)))) == ["token_count_mismatch"]


def test_a_generate_stream_must_grow_its_text():
    plan = Plan(0, "generate", {}, stream=True, max_tokens=2)
    first, last = generate_output([1], 1, finish=None), generate_output([1, 2], 2)
    first["meta_info"]["finish_reason"] = None
    last["text"] = "yy"
    events = [json.dumps(first), json.dumps(last), "[DONE]"]
    assert kinds(check_answer(plan, stream_answer(*events))) == ["stream_not_cumulative"]


# ---- errors and bad requests ----------------------------------------------------------------

def error_body(message: str, code: str = "x") -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def test_a_bad_request_needs_a_4xx_with_a_json_error_body():
    plan = Plan(0, "completions", b"{", bad="invalid_json")
    assert check_answer(plan, whole_answer(error_body("not JSON"), 400)).outcome == "rejected"
    assert kinds(check_answer(plan, whole_answer(b"<html>400 Bad Request</html>", 400))) == ["error_body_malformed"]
    assert kinds(check_answer(plan, whole_answer({"detail": "bad"}, 400))) == ["error_body_malformed"]
    assert kinds(check_answer(plan, whole_answer({"choices": []}))) == ["bad_request_accepted"]
    assert kinds(check_answer(plan, whole_answer(error_body("Internal server error."), 500))) == ["bad_request_not_4xx"]


def test_engine_failures_with_a_clear_message_are_allowed():
    plan = Plan(0, "completions", {}, max_tokens=4)
    assert check_answer(plan, whole_answer(error_body("overloaded"), 503)).outcome == "failed_clear"
    assert check_answer(plan, whole_answer(error_body("The engine failed: boom"), 500)).outcome == "failed_clear"
    assert kinds(check_answer(plan, whole_answer(error_body("Internal server error."), 500))) == ["unexpected_status"]
    assert kinds(check_answer(plan, whole_answer(b"Internal Server Error", 500))) == ["error_body_malformed"]


def test_an_error_event_must_say_what_failed():
    died = json.dumps(error_body("The engine is unavailable: rank 0 died"))
    assert check_answer(stream_plan(), stream_answer(GOOD_STREAM[0], died, "[DONE]")).outcome == "failed_clear"
    vague = json.dumps(error_body("oops"))
    assert kinds(check_answer(stream_plan(), stream_answer(GOOD_STREAM[0], vague, "[DONE]"))) == ["stream_error_event"]
    assert kinds(check_answer(stream_plan(), stream_answer(GOOD_STREAM[0], died))) == ["stream_incomplete"]


def test_timeouts_and_broken_connections_are_violations():
    assert kinds(check_answer(stream_plan(), Answer(timed_out=True))) == ["timeout"]
    assert kinds(check_answer(stream_plan(), Answer(error="ClientPayloadError: broken"))) == ["transport_error"]


def test_a_planned_disconnect_checks_only_what_was_read():
    answer = Answer(status=200, events=[GOOD_STREAM[0]], disconnected=True)
    assert check_answer(stream_plan(disconnect_after=1), answer).outcome == "disconnected"
    answer.events = ["{not json"]
    assert kinds(check_answer(stream_plan(disconnect_after=1), answer)) == ["stream_bad_json"]


# ---- determinism -----------------------------------------------------------------------------

def completion_of(*texts: str) -> Completion:
    return Completion({i: Choice(i, text, "length") for i, text in enumerate(texts)})


def test_a_greedy_answer_that_differs_from_the_first_is_caught():
    checker, key = Determinism(), ("greedy", "chat", 1, 8, (), False)
    assert checker.record(Plan(0, "chat", {}, determinism_key=key), completion_of("abc")) == []
    assert checker.record(Plan(1, "chat", {}, n=2, determinism_key=key), completion_of("abc", "abc")) == []
    problems = checker.record(Plan(2, "chat", {}, determinism_key=key), completion_of("abd"))
    assert [kind for kind, _ in problems] == ["greedy_mismatch"]
    assert checker.stats()["compared"]["greedy"] == 3


def test_seeded_choices_compare_by_seed_plus_index():
    checker, key = Determinism(), ("seeded", "completions", 1, 8, (), False)
    assert checker.record(Plan(0, "completions", {}, n=2, seed=1, determinism_key=key), completion_of("a", "b")) == []
    assert checker.record(Plan(1, "completions", {}, seed=2, determinism_key=key), completion_of("b")) == []
    problems = checker.record(Plan(2, "completions", {}, seed=1, determinism_key=key), completion_of("c"))
    assert [kind for kind, _ in problems] == ["seeded_mismatch"]


# ---- the mix, /proc and the summary's arithmetic ----------------------------------------------

def mix(seed: int = 1, bad: float = 0.0, disconnect: float = 0.0, prefix: float = 0.0,
        pool: list[Prompt] | None = None, structured: float = 0.0) -> Mix:
    args = soak.parse_args(["--no-dataset", "--seed", str(seed), "--bad-fraction", str(bad),
                            "--disconnect-fraction", str(disconnect), "--prefix-fraction", str(prefix),
                            "--structured-fraction", str(structured)])
    return Mix(args, pool or [Prompt(0, "def f(x):\n", 8), Prompt(1, "import os\n", 16)], "m", 2048)


def test_the_mix_repeats_itself_for_a_seed_and_resends_recipes():
    first, second = mix(), mix()
    plans = [first.plan(i) for i in range(200)]
    again = [second.plan(i) for i in range(200)]
    assert [p.body for p in plans] == [p.body for p in again]
    keys = [p.determinism_key for p in plans if p.determinism_key]
    assert len(keys) > 2 * len(set(keys))                   # greedy and seeded requests recur
    assert {p.endpoint for p in plans} == {"completions", "chat", "generate"}
    assert any(p.n > 1 for p in plans) and any(p.stops for p in plans) and any(p.logprobs for p in plans)


def test_the_structured_share_asks_each_endpoint_for_a_grammar_and_keeps_stop_strings_out():
    structured = mix(structured=0.5)
    plans = [p for p in (structured.plan(i) for i in range(300)) if not p.bad]
    constrained = [p for p in plans if p.grammar]
    assert 0.3 < len(constrained) / len(plans) < 0.7
    assert {p.grammar for p in constrained} == {"json_schema", "regex", "ebnf"}
    assert {p.endpoint for p in constrained} == {"completions", "chat", "generate"}
    for plan in constrained:
        fields = plan.body["sampling_params"] if plan.endpoint == "generate" else plan.body
        asked = {"json_schema": ("json_schema", "response_format"), "regex": ("regex",), "ebnf": ("ebnf",)}
        assert any(name in fields for name in asked[plan.grammar]) and not plan.stops and plan.max_tokens == 40
    plain, none = mix(), mix(structured=0.0)
    assert [plain.plan(i).body for i in range(50)] == [none.plan(i).body for i in range(50)]


def test_bad_and_disconnecting_plans():
    chaos = mix(bad=0.5, disconnect=1.0)
    plans = [chaos.plan(i) for i in range(400)]
    bad = [p for p in plans if p.bad]
    assert {p.bad for p in bad} == set(BAD_REQUESTS)
    assert all(p.stream and p.disconnect_after in (1, 2) for p in plans if not p.bad)
    assert all(isinstance(p.body, bytes) for p in bad if p.bad == "invalid_json")
    assert all(p.body["model"] == "no-such-model" for p in bad if p.bad == "wrong_model")


def prompt_text(plan) -> str:
    body = plan.body
    return body["messages"][0]["content"] if plan.endpoint == "chat" else body.get("prompt") or body["text"]


def test_the_prefix_mix_resends_and_continues_prompts_over_a_few_system_prompts():
    pool = [Prompt(i, text, 8) for i, text in enumerate(SHORT_PROMPTS)] + \
        [Prompt(len(SHORT_PROMPTS) + i, f"dataset prompt {i} " * 20, 16) for i in range(12)]
    chats = mix(prefix=0.6, pool=pool)
    texts = [prompt_text(chats.plan(i)) for i in range(400)]
    systems = chats.prefixes.systems
    prefixed = [text for text in texts if text.startswith(tuple(systems))]
    assert len(systems) == 4 and all(len(system) > 4 * len("dataset prompt 0 " * 20) for system in systems)
    assert 0.5 * len(texts) < len(prefixed) < 0.75 * len(texts)        # the share, and the resent recipes
    assert len(set(prefixed)) < 0.6 * len(prefixed)                      # prompts sent again whole
    turns = [text for text in set(prefixed) if any(text.startswith(other + "\n") for other in set(prefixed))]
    assert turns                                                         # an earlier prompt and a new question
    assert max(prompt.turn for prompt in chats.prefixes.sent) == 2
    assert {p.id for p in chats.prefixes.sent}.isdisjoint(p.id for p in pool)


def test_pages_that_do_not_add_up_are_violations():
    run = soak.Soak(soak.parse_args(["--no-dataset", "--disable-tqdm"]), FakeProbe(True), None, None)
    fine = dict(zip(PLACES, (100, 60, 30, 20, 10))) | {"tandem_prefix_cache_hit_tokens_total": 50.0,
                                                         "tandem_prefix_cache_prompt_tokens_total": 400.0,
                                                         "tandem_prefix_cache_evicted_tokens_total": 7.0,
                                                         "tandem_retractions_total": 2.0}
    run.pages.begin(fine | {"tandem_prefix_cache_hit_tokens_total": 10.0,
                            "tandem_prefix_cache_prompt_tokens_total": 200.0})
    run.pages.check(fine, "mid-run")
    run.pages.check(fine | {"tandem_kv_slots_free": 59}, "a page lost")
    run.pages.check(fine | {"tandem_kv_slots_owned": 11}, "a page in two places")
    run.pages.check(fine, "drained while requests hold pages", drained=True)
    run.pages.check(None, "no /metrics")
    assert run.tally.violations == {"kv_pages_mismatch": 3}
    assert [e.split(":")[0] for e in run.tally.examples["kv_pages_mismatch"]] == \
        ["a page lost", "a page in two places", "drained while requests hold pages"]
    drained = fine | {"tandem_kv_slots_free": 70, "tandem_prefix_cache_idle_tokens": 30, "tandem_kv_slots_owned": 0}
    run.pages.check(drained, "drained", drained=True)
    assert run.tally.violations == {"kv_pages_mismatch": 3}
    report = run.pages.report()
    assert report["checks"] == 5 and report["unmeasured"] == 1 and report["slots_at_end"]["free"] == 70
    assert report["prefix_cache"] == {"prompt_tokens": 200.0, "hit_tokens": 40.0, "evicted_tokens": 0.0,
                                      "hit_rate": 0.2, "cached_at_end": 30}
    assert report["retractions"] == 0.0


def test_the_listening_process_is_found_from_the_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert pid_listening_on(listener.getsockname()[1]) == os.getpid()


def test_gauges_and_rss_growth():
    text = ('# HELP x\ntandem_kv_slots_used 0.0\ntandem_requests_total{outcome="ok"} 3.0\n'
            'process_resident_memory_bytes 1e6\n')
    assert parse_gauges(text) == {"tandem_kv_slots_used": 0.0, "process_resident_memory_bytes": 1e6}
    samples = [RssSample(i, 0.0, front, 0, "proc") for i, front in enumerate((90, 100, 103, 110))]
    assert soak.rss_growth(samples, "total_bytes") == 10.0
    assert soak.rss_growth(samples[:2], "total_bytes") is None


@pytest.mark.parametrize("flags", [["--concurrency", "0"], ["--bad-fraction", "2"], ["--num-requests", "0"],
                                   ["--kill-rank-every", "0"]])
def test_bad_arguments_exit_2(flags):
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(["--no-dataset", *flags])
    assert exit_info.value.code == 2


# ---- killing ranks of a fake server -------------------------------------------------------------

# A "server" whose one child is its "rank": replaced when killed, left dead, or the server exits.
FAKE_SERVER = """
import subprocess, sys, time
while True:
    subprocess.Popen(["sleep", "600"]).wait()
    if sys.argv[1] == "exit":
        sys.exit(1)
    if sys.argv[1] == "stay-dead":
        time.sleep(600)
"""


class FakeProbe:
    session = None

    def __init__(self, healthy: bool):
        self.answer = healthy

    async def healthy(self) -> bool:
        return self.answer

    async def gauges(self) -> dict:
        return {}


@pytest.mark.parametrize("mode, healthy, outcome, violation", [
    ("restart", True, "recovered", None),
    ("stay-dead", False, "no_recovery", "no_recovery"),
    ("stay-dead", True, "rank_not_restarted", "rank_not_restarted"),
    ("exit", False, "server_exited", "server_exited"),
])
async def test_a_killed_rank_is_watched_until_it_is_back_or_the_wait_ends(mode, healthy, outcome, violation):
    server = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, mode], start_new_session=True)
    try:
        while not rank_pids(server.pid):
            await asyncio.sleep(0.05)
        rank = rank_pids(server.pid)[0]
        args = soak.parse_args(["--no-dataset", "--disable-tqdm", "--kill-rank-every", "1", "--recovery-timeout", "2"])
        run = soak.Soak(args, FakeProbe(healthy), None, server.pid)
        await run.kill_rank()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    event = run.kills[0]
    assert (event.pid, event.outcome) == (rank, outcome)
    assert (event.recovered_s is not None) == (outcome == "recovered")
    assert list(run.tally.violations) == ([violation] if violation else [])
    assert (run.stop_reason is not None) == (outcome in ("no_recovery", "server_exited"))


@pytest.mark.parametrize("failure, reason", [({"timed_out": True}, "looks stuck"),
                                             ({"error": "cannot connect", "refused": True}, "refused")])
def test_a_run_stops_when_every_request_fails_the_same_way(failure, reason):
    args = soak.parse_args(["--no-dataset", "--disable-tqdm", "--concurrency", "4"])
    run = soak.Soak(args, FakeProbe(True), None, None)
    for _ in range(soak.FAILURES_TO_STOP - 1):
        run.watch_server(Answer(**failure))
    run.watch_server(Answer(status=200))                 # one answer breaks the streak
    for _ in range(soak.FAILURES_TO_STOP - 1):
        run.watch_server(Answer(**failure))
    assert run.stop_reason is None
    run.watch_server(Answer(**failure))
    assert reason in run.stop_reason


# ---- the client against a fake server ------------------------------------------------------

async def fake_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_the_client_sees_a_cut_stream_and_hangs_up_when_planned():
    closed = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for chunk in GOOD_STREAM[:2]:
                await response.write(f"data: {chunk}\n\n".encode())
                await asyncio.sleep(0.2)
        except ConnectionError:
            closed.set()
        return response                     # no [DONE]

    runner, url = await fake_server(handler)
    args = soak.parse_args(["--no-dataset", "--base-url", url, "--timeout", "5"])
    try:
        async with aiohttp.ClientSession() as session:
            cut = await soak.send(session, args, stream_plan(include_usage=False))
            hung_up = await soak.send(session, args, stream_plan(disconnect_after=1))
            await asyncio.wait_for(closed.wait(), 5)
    finally:
        await runner.cleanup()
    assert kinds(check_answer(stream_plan(include_usage=False), cut)) == ["stream_incomplete"]
    assert hung_up.disconnected and check_answer(stream_plan(disconnect_after=1), hung_up).outcome == "disconnected"


# ---- a real server ------------------------------------------------------------------------------

@pytest.mark.slow
async def test_a_short_soak_against_a_real_server_finds_nothing(tmp_path):
    bad_kinds = ",".join(BAD_REQUESTS)
    # an unquantized draft head: repeats must not depend on how a prompt's prefill was chunked (docs/prefix-cache.md)
    with running_server(["--speculative-draft-quantization", "none"], tmp_path / "server.log") as server:
        args = soak.parse_args(["--base-url", server.url, "--num-requests", "60", "--concurrency", "8",
                                "--disconnect-fraction", "0.2", "--bad-fraction", "0.1", "--bad-kinds", bad_kinds,
                                "--num-prompts", "6", "--random-input-len", "48", "--random-output-len", "12",
                                "--structured-fraction", "0.3",
                                "--disable-tqdm", "--server-pid", str(server.process.pid)])
        summary = await soak.run_soak(args)
    assert summary["violations"] == {"total": 0, "by_kind": {}}, json.dumps(summary["violations"], indent=1)
    assert summary["end_state"]["tandem_kv_slots_used"] == 0
    by_kind = summary["requests"]["by_kind"]
    assert sum(c.get("ok", 0) for kind, c in by_kind.items() if kind.endswith("/grammar")) > 5
    outcomes = summary["requests"]["by_outcome"]
    assert outcomes["ok"] > 20 and outcomes["rejected"] > 0 and outcomes["disconnected"] > 0
    assert sum(summary["determinism"]["compared"].values()) > 0
    assert summary["memory"]["source"] == "proc" and summary["memory"]["growth_pct"] is not None


@pytest.mark.slow
async def test_a_prefix_heavy_soak_on_a_small_kv_budget_evicts_and_its_pages_add_up(tmp_path):
    """Most prompts over a few shared system prompts, on a pool that holds what 4 running requests need
    (so none is retracted: a retracted request's seeded tokens may differ under speculation) but far less
    than the prompts and answers together: the cache hits, evicts and is read again, every answer checks,
    and the pool's pages add up throughout. In float32 (the harness's) with an unquantized draft head, where
    a repeat's answer does not depend on how much of it was read from the cache (docs/prefix-cache.md:
    "Determinism")."""
    flags = ["--max-total-tokens", "1536", "--max-running-requests", "4", "--speculative-draft-quantization", "none"]
    with running_server(flags, tmp_path / "server.log") as server:
        args = soak.parse_args(["--base-url", server.url, "--num-requests", "120", "--concurrency", "8",
                                "--prefix-fraction", "0.7", "--disconnect-fraction", "0.1", "--bad-fraction", "0.02",
                                "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "12",
                                "--disable-tqdm", "--server-pid", str(server.process.pid)])
        summary = await soak.run_soak(args)
    assert summary["violations"] == {"total": 0, "by_kind": {}}, json.dumps(summary["violations"], indent=1)
    pages = summary["kv_pages"]
    assert pages["checks"] >= 3 and pages["unmeasured"] == 0           # at each memory sample and at the end
    end = pages["slots_at_end"]
    assert end["owned"] == 0 and end["free"] + end["cached"] == end["total"] == 1536
    cache = pages["prefix_cache"]
    assert cache["hit_tokens"] > 0 and cache["evicted_tokens"] > 0 and 0 < cache["hit_rate"] < 1
    assert pages["retractions"] == 0
    assert sum(summary["determinism"]["compared"].values()) > 0
