"""When speculation pays (--speculative-adaptive): a gate that runs plain decoding for the decode
launches where speculation is expected to lose. Pure Python: plain numbers in, a decision out
(spec/policy.py asks it; the rank's core feeds it what its device reported).

Per bucket of batch sizes (1, 2-3, 4-7, 8-15, 16-31, 32+ decoding requests) it keeps, per mode,
the last WINDOW launches charged to that mode, each as seconds and tokens per request (a row):

  speculative   its decode launches (the tokens each row emitted: accepted drafts + 1 a round), and
                the prefill launches its decodes waited for (no tokens): speculative decodes cannot
                share a batch with prompt chunks, so every arrival costs them a launch of their own
  plain         its decode launches (one token a row and step), prompt chunks beside them included:
                what plain decoding does with an arrival is fold it into a decode step

A launch that served prompts too counts no more seconds than its mode's typical launch (Bucket.charged):
the prompts' time is paid in either mode.

Seconds are a launch's cycle (engine/core.py): from the end of the launch before it on the device to
its own end, so that time the device waited for the loop to prepare a launch counts against its mode
(a speculative round asks more of the loop than a plain step), and so does work deferred to it (an
EAGLE head reads a prompt in the launch after the prompt's).

Expected decode rate of a request in a mode: its window's tokens over its seconds, each launch's
seconds clipped to CLIP times the window's lower median (a pause on a busy machine does not move
it). A bucket that speculates turns plain once the ratio speculative / plain falls below LEAVE,
and speculates again once it rises above RETURN: between the two a bucket keeps its mode, so noise
in the estimates does not flip it launch after launch.

A switch needs the other mode's rate from the chosen mode's time: where the other mode was last
measured a whole WINDOW of the chosen mode's launches ago, the gate explores it at once and decides
on what that run measures (a machine whose speed drifts would otherwise read a slow spell of the
chosen mode as the other one winning).

A bucket first measures each mode over WARM decode launches (speculation first); then the mode not
chosen still runs EXPLORE_RUN launches after every so many of the bucket's (the first time after
EXPLORE_EVERY: a fresh server's first launches are the least like the rest), so that a change in
acceptance (text that drafts better) or in cost (longer contexts, more load) is noticed. How many:
enough that exploring costs about EXPLORE_COST of the bucket's time at the rates measured (a mode that
loses by 40% is tried less often than one that loses by 5%), within EXPLORE_EVERY..EXPLORE_MAX. Runs, not
single launches: a mode's first launch carries work deferred from before it (an EAGLE head reads the
prompts of the requests it explores with in their first decode launch), which a single launch would
weigh as if every launch of the mode paid it. A launch counts once it is fed: a plain launch planned
while a drafting step is in flight is a chain-0 step first (spec/policy.py), and the exploration waits
for the launch it wanted.

The gate decides for all-greedy batches only: which steps speculate changes the tokens a sampling
request draws, and a run with the same requests must draw the same tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median_low
from typing import NamedTuple

BUCKETS = (1, 2, 4, 8, 16, 32)     # lower bounds of the batch-size buckets
LEAVE = 0.98            # speculate -> plain below this ratio of expected rates (speculation loses)
RETURN = 1.05           # plain -> speculate above it (speculation wins by a margin)
EXPLORE_EVERY = 16      # after at least this many launches of a bucket in its mode, it runs the other one ...
EXPLORE_MAX = 256       # ... and at most this many ...
EXPLORE_RUN = 4         # ... for this many launches ...
EXPLORE_COST = 0.01     # ... so that exploring loses about this share of the bucket's time
WINDOW = 12             # launches a mode's estimate spans
CLIP = 4.0              # a launch counts no more seconds than this many times its window's lower median
WARM = 4                # decode launches each mode is measured over before the gate chooses (as many as a run)


def bucket_of(rows: int) -> int:
    """Index of the bucket of a batch of `rows` decoding requests."""
    return max(i for i, low in enumerate(BUCKETS) if rows >= low)


def bucket_label(index: int) -> str:
    low = BUCKETS[index]
    if index + 1 == len(BUCKETS):
        return f"{low}+"
    high = BUCKETS[index + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


class Charge(NamedTuple):
    """One launch charged to a mode, per row: its cycle, and the tokens it emitted (0: a wait)."""
    seconds: float
    tokens: float


def rate(window: deque[Charge]) -> float | None:
    """Tokens per second of a request over the window (None: nothing charged). A window of waits alone
    (speculative decodes that waited for prefill launches, arrival after arrival) emitted nothing: 0."""
    if not window:
        return None
    limit = CLIP * median_low(charge.seconds for charge in window)
    return sum(charge.tokens for charge in window) / sum(min(charge.seconds, limit) for charge in window)


@dataclass
class Bucket:
    """What one bucket measured and decided."""
    spec: deque[Charge] = field(default_factory=lambda: deque(maxlen=WINDOW))
    plain: deque[Charge] = field(default_factory=lambda: deque(maxlen=WINDOW))
    spec_launches: int = 0               # decode launches measured in each mode (up to WARM)
    plain_launches: int = 0
    speculating: bool = True             # the mode chosen (exploration aside)
    since_other: int = 0                 # launches fed in the chosen mode since the other one ran
    explored: int = 0                    # launches of the exploration under way fed
    explored_once: bool = False          # a run of the other mode after the first choice has completed
    spec_age: int = 0                    # plain launches charged since the last speculative one, and back
    plain_age: int = 0

    def charged(self, speculative: bool, charge: Charge, one_launch: bool = False) -> None:
        """one_launch: a launch that served prompts too (a prefill the decodes waited for, or plain steps
        with prompt chunks beside them) counts no more seconds than the mode's typical launch. Its length
        is the prompts' (each mode pays it); what the mode costs there is one launch of its own or one
        step folded in: a burst of prompts must not read as one mode decoding slowly."""
        window = self.spec if speculative else self.plain
        if one_launch and window:
            charge = Charge(min(charge.seconds, median_low(c.seconds for c in window)), charge.tokens)
        window.append(charge)
        if speculative:
            self.spec_age, self.plain_age = 0, self.plain_age + 1
        else:
            self.plain_age, self.spec_age = 0, self.spec_age + 1

    def other_is_stale(self) -> bool:
        """Is the mode not chosen known only from before the chosen mode's whole window? Its rate is then
        from another moment of a machine whose speed drifts, and not to be switched to on its own."""
        return (self.plain_age if self.speculating else self.spec_age) >= WINDOW

    def spec_rate(self) -> float | None:
        """Expected tokens per second of a request while speculating (None: not measured)."""
        return rate(self.spec)

    def plain_rate(self) -> float | None:
        return rate(self.plain)

    def explore_after(self) -> int:
        """Launches in the chosen mode before the other one runs EXPLORE_RUN launches. The first time soon:
        the first choice rests on a fresh server's first launches, the least like the ones after."""
        spec, plain = self.spec_rate(), self.plain_rate()
        if not spec or not plain or not self.explored_once:
            return EXPLORE_EVERY
        loss = 1 - (plain / spec if self.speculating else spec / plain)
        return min(EXPLORE_MAX, max(EXPLORE_EVERY, round(EXPLORE_RUN * loss / EXPLORE_COST)))

    def exploring(self) -> bool:
        """Is the other mode due (or running: a run under way goes on whatever the rates do meanwhile)?"""
        return self.explored > 0 or self.since_other >= self.explore_after()

    def warming(self) -> bool | None:
        """The mode to measure before choosing (speculation first), or None: both are measured."""
        if self.spec_launches < WARM:
            return True
        return False if self.plain_launches < WARM else None


@dataclass(frozen=True)
class Estimate:
    """A bucket's estimates, for /metrics (rates 0 where not measured yet)."""
    label: str
    spec_tokens_per_s: float
    plain_tokens_per_s: float
    speculating: bool


class SpecGate:
    def __init__(self) -> None:
        self.buckets = [Bucket() for _ in BUCKETS]
        self.explorations = 0       # launches fed in the mode their bucket did not choose

    def speculate(self, rows: int, queued: bool = True) -> bool:
        """Should the next decode launch of `rows` all-greedy requests speculate? queued: requests wait for
        a place. Exploring speculation from a plain bucket of several rows waits for that: the rows it
        speculates for finish unevenly, and with no request to take a finished row's place the batch's
        last rows run on alone, a cost the run's own launches do not show (docs/speculation-gate.md)."""
        bucket = self.buckets[bucket_of(rows)]
        warming = bucket.warming()
        if warming is not None:
            return warming
        spec, plain = bucket.spec_rate(), bucket.plain_rate()
        if bucket.speculating and spec < LEAVE * plain or not bucket.speculating and spec > RETURN * plain:
            if not bucket.other_is_stale():
                bucket.speculating, bucket.since_other, bucket.explored = not bucket.speculating, 0, 0
            elif not bucket.exploring():         # measure the other mode now, then decide
                bucket.since_other = EXPLORE_MAX
        if bucket.exploring():
            return not bucket.speculating and (queued or rows == 1)
        return bucket.speculating

    def settled_plain(self, rows: int) -> bool:
        """Has the bucket of `rows` chosen plain decoding on both modes' measurements (not merely not
        measured speculation yet, nor exploring plain steps from a speculating bucket)?"""
        bucket = self.buckets[bucket_of(rows)]
        return not bucket.speculating and bucket.warming() is None

    def skip_prompts(self, rows: int) -> bool:
        """Greedy prompts arrive while `rows` requests run: may the draft skip them (their requests will
        decode plainly)? Where the bucket is settled on plain, except when it is due to explore: then the
        prompts are read and their requests' first decode launch speculates. Counts as a launch fed plain."""
        bucket = self.buckets[bucket_of(max(rows, 1))]
        if not self.settled_plain(max(rows, 1)) or bucket.exploring():
            return False
        bucket.since_other += 1
        return True

    def fed(self, rows: int, speculative: bool) -> None:
        """A decode launch of `rows` all-greedy requests was fed in this mode."""
        bucket = self.buckets[bucket_of(rows)]
        if speculative == bucket.speculating:
            if bucket.explored:          # the run was cut short (a batch that could not explore)
                bucket.since_other = bucket.explored = 0
            bucket.since_other += 1
            return
        if not bucket.exploring():              # measuring it (warming), or a switch of mode
            bucket.since_other = 0
            return
        bucket.explored += 1
        self.explorations += 1
        if bucket.explored >= EXPLORE_RUN:
            bucket.since_other = bucket.explored = 0
            bucket.explored_once = True

    def observe(self, rows: int, speculative: bool, seconds: float, steps: int, tokens: int = 0,
                beside_prompts: bool = False) -> None:
        """A decode launch of `rows` all-greedy requests ran `steps` steps (rounds) in a cycle of
        `seconds`; speculative: its rows emitted `tokens` in all (plain: one a row and step);
        beside_prompts: prompt chunks shared the launch (Bucket.charged: one_launch)."""
        if rows < 1 or steps < 1 or seconds <= 0:
            return
        bucket = self.buckets[bucket_of(rows)]
        if speculative:
            bucket.charged(True, Charge(seconds / rows, tokens / rows))
            bucket.spec_launches = min(WARM, bucket.spec_launches + 1)
        else:
            bucket.charged(False, Charge(seconds / rows, float(steps)), one_launch=beside_prompts)
            bucket.plain_launches = min(WARM, bucket.plain_launches + 1)

    def waited(self, rows: int, seconds: float) -> None:
        """`rows` speculating all-greedy requests waited a cycle of `seconds` for a prefill launch."""
        if rows >= 1 and seconds > 0:
            self.buckets[bucket_of(rows)].charged(True, Charge(seconds / rows, 0.0), one_launch=True)

    def estimates(self) -> list[Estimate]:
        """Every bucket that measured something."""
        return [Estimate(bucket_label(i), b.spec_rate() or 0.0, b.plain_rate() or 0.0, b.speculating)
                for i, b in enumerate(self.buckets) if b.spec or b.plain]

    @staticmethod
    def describe() -> str:
        """For the start-up log line."""
        labels = ", ".join(bucket_label(i) for i in range(len(BUCKETS)))
        return (f"adaptive: per batch size ({labels} requests), greedy batches decode plainly where "
                f"speculation is expected to lose (below {LEAVE:g}x plain's rate, back above {RETURN:g}x), "
                f"each mode measured as it serves (speculation charged the prefill launches its decodes wait "
                f"for), the other tried {EXPLORE_RUN} launches at a time, for about {EXPLORE_COST:.0%} of the time")
