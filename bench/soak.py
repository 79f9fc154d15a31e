"""Soak and chaos test of a running server: a long mixed load that checks every answer.

    python bench/soak.py --port 30000 --num-requests 2000 --concurrency 16 \\
        --disconnect-fraction 0.2 --bad-fraction 0.05 --output-file soak.json
    python bench/soak.py --port 30000 --duration 30 --kill-rank-every 500     # a --dp-size 2 server
    python bench/soak.py --port 30000 --prefix-fraction 0.6      # most prompts share long prefixes

Requests mix /v1/completions, /v1/chat/completions and /generate, streamed or whole, with
greedy, temperature, top-p and seeded sampling, n > 1, stop strings and logprobs; some
clients hang up mid-stream and some send bad requests; --prefix-fraction of the good ones
start with a few shared system prompts (bench/soak_mix.py). Every answer is checked
(bench/soak_checks.py); during the run and at its end the KV pool's pages must add up
(bench/soak_pages.py); at the end the server must have freed every KV slot, and its
resident memory must not have grown by more than --max-rss-growth percent. Prints a JSON
summary (also written to --output-file); exits 1 on any violation, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

if __package__ in (None, ""):           # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serving
from bench.soak_checks import Answer, Determinism, Plan, check_answer
from bench.soak_mix import BAD_REQUESTS, PATHS, Mix, prompt_pool
from bench.soak_pages import PageWatch
from bench.soak_report import KillEvent, Tally, rss_growth, summarize
from bench.soak_server import (RssSample, alive, parse_gauges, pid_listening_on, rank_pids, sample_gauges,
                               sample_proc, started)

MONITOR_CONNECTIONS = 2     # /health and /metrics polls beside the load, so they never queue behind it
RSS_SAMPLES = 10            # a sample after every tenth of the run (every 1000 requests in long runs)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
BACKOFF_AFTER_503_S = 1.0
FAILURES_TO_STOP = 10       # connections refused, or timeouts, in a row (at least --concurrency): stop
EXIT_HINT = "the server process exited (Tandem exits after more than --max-rank-restarts rank deaths in 10 minutes)"
DRAIN_GAUGES = ("tandem_kv_slots_used", "tandem_num_running_reqs", "tandem_num_waiting_reqs")


# ---- the client -------------------------------------------------------------------------

async def send(session: aiohttp.ClientSession, args, plan: Plan) -> Answer:
    """One request, read to its end (or to its planned disconnect) within --timeout."""
    answer = Answer(start=time.monotonic())
    try:
        async with asyncio.timeout(args.timeout):
            await exchange(session, args, plan, answer)
    except TimeoutError:
        answer.timed_out = True
    except aiohttp.ClientConnectorError as exc:
        answer.error, answer.refused = f"cannot connect: {exc}"[:200], True
    except (aiohttp.ClientError, ConnectionError, UnicodeDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    answer.end = time.monotonic()
    return answer


async def exchange(session: aiohttp.ClientSession, args, plan: Plan, answer: Answer) -> None:
    url = args.base_url + PATHS[plan.endpoint]
    if isinstance(plan.body, bytes):
        request = {"data": plan.body, "headers": {**args.headers, "Content-Type": "application/json"}}
    else:
        request = {"json": plan.body, "headers": args.headers}
    async with session.post(url, **request) as response:
        answer.status = response.status
        if response.status != 200 or not plan.stream:
            answer.body = await response.read()
            return
        async for now, payload in serving.sse_payloads(response):
            answer.ttft = answer.ttft if answer.ttft is not None else now - answer.start
            answer.events.append(payload)
            if plan.disconnect_after and len(answer.events) >= plan.disconnect_after:
                answer.disconnected = True
                response.close()            # drop the connection: the server must abort the request
                return


class Probe:
    """GETs beside the load: /v1/models, /health, /metrics (None when the server does not answer)."""

    def __init__(self, session: aiohttp.ClientSession, args):
        self.session, self.args = session, args

    async def get(self, path: str) -> tuple[int, str] | None:
        try:
            async with asyncio.timeout(10):
                async with self.session.get(self.args.base_url + path, headers=self.args.headers) as response:
                    return response.status, await response.text()
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return None

    async def healthy(self) -> bool:
        answer = await self.get("/health")
        return answer is not None and answer[0] == 200

    async def gauges(self) -> dict[str, float] | None:
        answer = await self.get("/metrics")
        return parse_gauges(answer[1]) if answer is not None and answer[0] == 200 else None

    async def model(self) -> tuple[str | None, int]:
        """The served model's name and context length (None and a huge one when not listed)."""
        answer = await self.get("/v1/models")
        try:
            first = json.loads(answer[1])["data"][0]
            return first["id"], int(first.get("max_model_len") or 10**7)
        except (TypeError, ValueError, KeyError, IndexError):
            return None, 10**7


# ---- the run ------------------------------------------------------------------------------

class Soak:
    """Workers take plans from the mix, send them and record the verdicts; between requests it
    samples memory and kills ranks when due."""

    def __init__(self, args, probe: Probe, mix: Mix, server_pid: int | None):
        self.args, self.probe, self.mix, self.server_pid = args, probe, mix, server_pid
        self.tally, self.determinism = Tally(), Determinism()
        self.pages = PageWatch(self.tally)
        self.t0 = time.monotonic()
        self.issued = self.done = 0
        self.stop_reason: str | None = None
        self.server_gone = False            # exited or refusing connections: nothing left to measure
        self.refusals_in_a_row = self.timeouts_in_a_row = 0
        self.kills: list[KillEvent] = []
        self.kill_task: asyncio.Task | None = None
        self.next_kill_at = args.kill_rank_every or 0
        self.rss: list[RssSample] = []
        self.rss_tasks: set[asyncio.Task] = set()
        self.rss_every = min(1000, math.ceil(args.num_requests / RSS_SAMPLES)) if args.num_requests else None
        self.next_rss_s = (args.duration or 0) * 60 / RSS_SAMPLES
        self.end_state: dict = {}
        self.last_gauges: dict[str, float] | None = None    # the drained server's (wait_drained)
        from tqdm import tqdm
        self.bar = tqdm(total=args.num_requests, desc="soak", unit="req", file=sys.stderr, disable=args.disable_tqdm)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.bar.write(f"soak: stopping early: {reason}", file=sys.stderr)

    def next_plan(self) -> Plan | None:
        if self.stop_reason is not None or (self.args.num_requests and self.issued >= self.args.num_requests):
            return None
        if self.args.duration and self.elapsed() >= self.args.duration * 60:
            return None
        self.issued += 1
        self.maybe_kill(self.issued - 1)
        return self.mix.plan(self.issued - 1)

    async def worker(self) -> None:
        while (plan := self.next_plan()) is not None:
            answer = await send(self.probe.session, self.args, plan)
            self.record(plan, answer)
            if answer.status == 503:        # come back later, as a client should: the run is not spent on 503s
                await asyncio.sleep(BACKOFF_AFTER_503_S)

    def record(self, plan: Plan, answer: Answer) -> None:
        verdict = check_answer(plan, answer)
        if verdict.outcome == "ok" and verdict.completion is not None:
            verdict.violations += self.determinism.record(plan, verdict.completion)
            verdict.outcome = "violation" if verdict.violations else "ok"
        self.tally.add(plan, answer, verdict.outcome, verdict.violations, verdict.note, self.t0)
        self.done += 1
        self.bar.update(1)
        if verdict.violations:
            self.bar.set_postfix(violations=sum(self.tally.violations.values()), refresh=False)
        self.watch_server(answer)
        self.maybe_sample_rss()

    def watch_server(self, answer: Answer) -> None:
        """Stop when the server is gone or stuck rather than fail every request left."""
        self.refusals_in_a_row = self.refusals_in_a_row + 1 if answer.refused else 0
        self.timeouts_in_a_row = self.timeouts_in_a_row + 1 if answer.timed_out else 0
        enough = max(FAILURES_TO_STOP, self.args.concurrency)
        if self.timeouts_in_a_row >= enough:
            self.stop(f"{self.timeouts_in_a_row} requests in a row got no answer in {self.args.timeout:g} s: "
                      "the server looks stuck")
        if self.server_gone or not answer.error:
            return
        if self.server_pid is not None and not alive(self.server_pid):
            self.server_exited()
        elif self.refusals_in_a_row >= enough:
            self.server_gone = True
            self.stop(f"the server refused {self.refusals_in_a_row} connections in a row")

    def server_exited(self) -> None:
        """Counted once, however it was noticed (a kill's watch, a failed request, the end of the run)."""
        self.server_gone = True
        if "server_exited" not in self.tally.violations:
            self.tally.violation("server_exited", f"process {self.server_pid} at {self.elapsed():.1f} s: {EXIT_HINT}")
            self.stop(EXIT_HINT)

    async def run(self) -> None:
        self.pages.begin(await self.probe.gauges())
        await asyncio.gather(*(self.worker() for _ in range(self.args.concurrency)))
        if self.kill_task is not None:
            await self.kill_task
        if self.server_pid is not None and not alive(self.server_pid):
            self.server_exited()
        self.bar.close()
        await asyncio.gather(*self.rss_tasks)
        if self.server_gone:
            self.end_state = {"not_measured": self.stop_reason}
            return
        self.end_state = await self.wait_drained()
        drained = self.end_state["drained_after_s"] is not None
        self.pages.check(self.last_gauges, "once drained" if drained else "at the end", drained=drained)
        await self.sample_rss()
        self.check_rss_growth()

    # ---- memory --------------------------------------------------------------------------

    def maybe_sample_rss(self) -> None:
        if self.rss_every is not None:
            due = self.done % self.rss_every == 0
        else:
            due = self.elapsed() >= self.next_rss_s
            self.next_rss_s += (self.args.duration * 60 / RSS_SAMPLES) if due else 0
        if due:
            task = asyncio.ensure_future(self.sample_rss())
            self.rss_tasks.add(task)
            task.add_done_callback(self.rss_tasks.discard)

    async def sample_rss(self) -> None:
        """From /proc when the server's PID is known, else from its gauges."""
        if self.server_pid is not None:
            sample = sample_proc(self.server_pid, self.done, round(self.elapsed(), 2))
        else:
            sample = sample_gauges(await self.probe.gauges() or {}, self.done, round(self.elapsed(), 2))
        if sample is not None:
            self.rss.append(sample)
        self.pages.check(await self.probe.gauges(), f"after {self.done} requests")

    def rss_basis(self) -> str:
        """Killed ranks come back with fresh memory: after a kill, only the front's growth means anything."""
        return "front_bytes" if self.kills else "total_bytes"

    def check_rss_growth(self) -> None:
        growth = rss_growth(self.rss, self.rss_basis())
        if growth is not None and growth > self.args.max_rss_growth:
            first, last = self.rss[1], self.rss[-1]
            self.tally.violation("rss_growth", f"{self.rss_basis()} grew {growth}% (> {self.args.max_rss_growth}%) "
                                 f"from {getattr(first, self.rss_basis())} at {first.requests} requests "
                                 f"to {getattr(last, self.rss_basis())} at {last.requests}")

    # ---- killing ranks -------------------------------------------------------------------

    def maybe_kill(self, index: int) -> None:
        """After every --kill-rank-every requests, one kill at a time (the next waits for recovery)."""
        every = self.args.kill_rank_every
        if not every or index < self.next_kill_at or (self.kill_task is not None and not self.kill_task.done()):
            return
        self.next_kill_at = index + every
        self.kill_task = asyncio.ensure_future(self.kill_rank())

    async def kill_rank(self) -> None:
        """SIGKILL the longest-lived rank (so ranks take turns as they are restarted), then watch."""
        ranks = sorted(rank_pids(self.server_pid), key=started)
        if not ranks:
            self.tally.violation("no_rank_to_kill", f"server {self.server_pid} has no rank process at "
                                 f"{self.elapsed():.1f} s")
            return
        ranks_up = (await self.probe.gauges() or {}).get("tandem_ranks_up")
        event = KillEvent(len(self.kills) + 1, ranks[0], round(self.elapsed(), 2), len(ranks))
        self.kills.append(event)
        os.kill(ranks[0], signal.SIGKILL)
        self.bar.write(f"soak: killed rank pid {ranks[0]} at {event.at_s} s ({self.issued} requests sent)",
                       file=sys.stderr)
        await self.watch_recovery(event, ranks_up)

    async def watch_recovery(self, event: KillEvent, ranks_up_before: float | None) -> None:
        deadline = time.monotonic() + self.args.recovery_timeout
        healthy, polled = False, time.monotonic()
        while time.monotonic() < deadline:
            if not alive(self.server_pid):
                event.outcome, event.unhealthy_s = "server_exited", round(event.unhealthy_s, 2)
                return self.server_exited()
            healthy = await self.probe.healthy()
            now = time.monotonic()
            event.unhealthy_s += 0.0 if healthy else now - polled
            polled = now
            if healthy and await self.ranks_back(event, ranks_up_before):
                event.recovered_s, event.outcome = round(self.elapsed() - event.at_s, 2), "recovered"
                event.unhealthy_s = round(event.unhealthy_s, 2)
                return
            await asyncio.sleep(0.25)
        if healthy:
            return self.kill_failed(event, "rank_not_restarted", f"/health is 200 but the rank was not replaced "
                                    f"within {self.args.recovery_timeout:g} s")
        self.kill_failed(event, "no_recovery", f"/health not 200 within {self.args.recovery_timeout:g} s")

    async def ranks_back(self, event: KillEvent, ranks_up_before: float | None) -> bool:
        """As many rank processes as before the kill (the killed one gone), and as many ranks up."""
        ranks = rank_pids(self.server_pid)
        if event.pid in ranks or len(ranks) < event.ranks_before:
            return False
        up = (await self.probe.gauges() or {}).get("tandem_ranks_up") if ranks_up_before is not None else None
        return ranks_up_before is None or (up is not None and up >= ranks_up_before)

    def kill_failed(self, event: KillEvent, kind: str, message: str) -> None:
        event.outcome, event.unhealthy_s = kind, round(event.unhealthy_s, 2)
        self.tally.violation(kind, f"kill {event.number} (rank pid {event.pid} at {event.at_s} s): {message}")
        if kind == "no_recovery":               # nothing more to learn from a server that is down
            self.stop(f"after killing rank pid {event.pid}: {message}")

    # ---- the end -------------------------------------------------------------------------

    async def wait_drained(self) -> dict:
        """Poll /metrics until no KV slot is used and no request runs or waits (--drain-timeout)."""
        start = time.monotonic()
        while True:
            gauges = self.last_gauges = await self.probe.gauges()
            values = {name: (gauges or {}).get(name) for name in DRAIN_GAUGES}
            waited = round(time.monotonic() - start, 2)
            if all(value == 0 for value in values.values()):
                return {**values, "drained_after_s": waited}
            if waited >= self.args.drain_timeout:
                self.tally.violation("kv_not_freed", f"after {waited} s: {values if gauges else 'no /metrics'}")
                return {**values, "drained_after_s": None}
            await asyncio.sleep(0.5)


# ---- arguments and main ------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="Sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY).")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="Requests to send (default 1000 without --duration; with it, whichever ends first).")
    parser.add_argument("--duration", type=float, default=None, metavar="MINUTES", help="Send requests this long.")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests in flight at once.")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1,
                        help="Share of requests that stream and hang up after one or two events.")
    parser.add_argument("--bad-fraction", type=float, default=0.05, help="Share of requests with bad input.")
    parser.add_argument("--prefix-fraction", type=float, default=0.0,
                        help="Share of the good requests whose prompt starts with one of a few long shared system "
                             "prompts (new questions, prompts sent again, a chat's next turn): prefix-cache traffic.")
    parser.add_argument("--bad-kinds", type=lambda text: text.split(","), default=list(BAD_REQUESTS),
                        help=f"Comma-separated kinds of bad input to send, of: {','.join(BAD_REQUESTS)}.")
    parser.add_argument("--timeout", type=float, default=120.0, help="Seconds one request may take (a violation).")
    parser.add_argument("--no-dataset", action="store_true", help="Only the short fixed prompts (no tokenizer).")
    add_server_args(parser)
    serving.add_workload_args(parser)
    for action in parser._actions:      # the shared flag's help speaks of requests; here it sizes the pool
        if action.dest == "num_prompts":
            action.help = "Dataset prompts in the pool requests are drawn from (besides the short fixed ones)."
    parser.set_defaults(num_prompts=16, random_input_len=128, random_output_len=32)
    parser.add_argument("--output-file", default=None, help="Write the JSON summary here too.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags about the server's processes, health and memory."""
    parser.add_argument("--server-pid", type=int, default=None,
                        help="The server's PID (default: the process listening on the port, when it is local).")
    parser.add_argument("--kill-rank-every", type=int, default=None, metavar="N",
                        help="SIGKILL one rank process (a child of the server, in turn) after every N requests.")
    parser.add_argument("--recovery-timeout", type=float, default=60.0,
                        help="Seconds a killed rank has to be back, with /health 200.")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="Seconds the KV and request gauges have to reach 0 at the end.")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, metavar="PCT",
                        help="Most resident-memory growth (percent, from the 2nd tenth of the run to the end).")


def finish_args(args) -> None:
    """Derived fields, and ValueError for bad values."""
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    args.tokenizer = args.tokenizer or serving.DEFAULT_TOKENIZER
    if args.num_requests is None and args.duration is None:
        args.num_requests = 1000
    check_load_args(args)
    check_workload_args(args)


def check_load_args(args) -> None:
    if (args.num_requests is not None and args.num_requests < 1) or (args.duration is not None and args.duration <= 0):
        raise ValueError("--num-requests must be at least 1 and --duration positive")
    if args.concurrency < 1 or args.timeout <= 0 or args.recovery_timeout <= 0 or args.drain_timeout < 0:
        raise ValueError("--concurrency must be at least 1 and the timeouts positive")
    if not all(0 <= share <= 1 for share in (args.disconnect_fraction, args.bad_fraction, args.prefix_fraction)):
        raise ValueError("--disconnect-fraction, --bad-fraction and --prefix-fraction must be in [0, 1]")
    if args.kill_rank_every is not None and args.kill_rank_every < 1:
        raise ValueError("--kill-rank-every must be at least 1")


def check_workload_args(args) -> None:
    unknown = set(args.bad_kinds) - set(BAD_REQUESTS)
    if unknown or not args.bad_kinds:
        raise ValueError(f"--bad-kinds: unknown {sorted(unknown)}; the kinds are {', '.join(BAD_REQUESTS)}")
    if args.no_dataset:
        return
    if not Path(args.tokenizer).is_dir():
        raise ValueError(f"tokenizer folder {args.tokenizer} not found (pass --tokenizer, or --no-dataset)")
    if args.dataset_name == "prompts" and not (args.dataset_path and Path(args.dataset_path).is_file()):
        raise ValueError("--dataset-name prompts needs --dataset-path to a JSONL file")


def find_server_pid(args) -> int | None:
    """--server-pid, else the local process listening on the URL's port."""
    if args.server_pid is not None:
        return args.server_pid
    url = urlparse(args.base_url)
    if url.hostname not in LOCAL_HOSTS:
        return None
    return pid_listening_on(url.port or (443 if url.scheme == "https" else 80))


async def run_soak(args) -> dict:
    """Run the soak described by `args` (see parse_args) and return its summary."""
    pool = prompt_pool(args)
    connector = aiohttp.TCPConnector(limit=args.concurrency + MONITOR_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        probe = Probe(session, args)
        model, context_length = await probe.model()
        server_pid = find_server_pid(args)
        if args.kill_rank_every and server_pid is None:
            raise ValueError("--kill-rank-every needs the server's PID: a local server, or --server-pid")
        soak = Soak(args, probe, Mix(args, pool, model, context_length), server_pid)
        await soak.run()
        return summarize(soak, soak.elapsed())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        finish_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = asyncio.run(run_soak(args))
    except ValueError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output_file:
        Path(args.output_file).write_text(text + "\n")
    return 1 if summary["violations"]["total"] else 0


if __name__ == "__main__":
    sys.exit(main())
