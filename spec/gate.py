"""When speculation pays (--speculative-adaptive): a gate that runs plain decoding for the decode
launches where speculation is expected to lose. Pure Python: plain numbers in, a decision out
(spec/policy.py asks it; the rank's core feeds it what its device reported).

Per bucket of batch sizes (1, 2-3, 4-7, 8-15, 16-31, 32+ decoding requests) it keeps what
all-greedy decode launches of that size measured, per request of the batch (a row):

  speculative rounds   seconds per row and round; tokens a row emits per round (its accepted
                       drafts + 1)
  plain steps          seconds per row and step (each emits one token)

Seconds are a launch's cycle (engine/core.py): from the end of the launch before it on the device to
its own end, so that time the device waited for the loop to prepare a launch counts against its mode
(a speculative round asks more of the loop than a plain step).

Expected decode rate of a request: speculative = tokens per round / seconds per round, plain =
1 / seconds per step. A bucket that speculates turns plain once the ratio speculative / plain
falls below LEAVE, and speculates again once it rises above RETURN: between the two a bucket keeps
its mode, so noise in the estimates does not flip it launch after launch.

The mode not chosen still runs one launch in EXPLORE_EVERY of the bucket's, so that a change in
acceptance (text that drafts better) or in cost (longer contexts, more load) is noticed; a bucket
with no estimate of a mode tries it (speculation first). A launch counts once it is fed: a plain
launch planned while a drafting step is in flight is a chain-0 step first (spec/policy.py), and
the exploration waits for the launch it wanted.

Estimates: seconds are the lower median of the bucket's last RECENT launches of that mode (a
pause on a busy machine does not move them), tokens per round a moving average (ACCEPT_WEIGHT
per launch). The gate decides for all-greedy batches only: which steps speculate changes the
tokens a sampling request draws, and a run with the same requests must draw the same tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median_low

BUCKETS = (1, 2, 4, 8, 16, 32)     # lower bounds of the batch-size buckets
LEAVE = 0.98            # speculate -> plain below this ratio of expected rates (speculation loses)
RETURN = 1.05           # plain -> speculate above it (speculation wins by a margin)
EXPLORE_EVERY = 16      # one launch in this many of a bucket runs the mode it did not choose
RECENT = 5              # seconds: the lower median of a mode's last RECENT launches
ACCEPT_WEIGHT = 0.25    # tokens per round: a launch's weight in the moving average


def bucket_of(rows: int) -> int:
    """Index of the bucket of a batch of `rows` decoding requests."""
    return max(i for i, low in enumerate(BUCKETS) if rows >= low)


def bucket_label(index: int) -> str:
    low = BUCKETS[index]
    if index + 1 == len(BUCKETS):
        return f"{low}+"
    high = BUCKETS[index + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


@dataclass
class Bucket:
    """What one bucket measured and decided."""
    spec_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))   # per row and round
    plain_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # per row and step
    tokens_per_round: float = 0.0        # per row; 0: no speculative round measured yet
    speculating: bool = True             # the mode chosen (exploration aside)
    since_other: int = 0                 # launches fed in the chosen mode since the other one ran

    def spec_rate(self) -> float | None:
        """Expected tokens per second of a request while speculating (None: not measured)."""
        if not self.spec_seconds or not self.tokens_per_round:
            return None
        return self.tokens_per_round / median_low(self.spec_seconds)

    def plain_rate(self) -> float | None:
        return 1.0 / median_low(self.plain_seconds) if self.plain_seconds else None


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

    def speculate(self, rows: int) -> bool:
        """Should the next decode launch of `rows` all-greedy requests speculate?"""
        bucket = self.buckets[bucket_of(rows)]
        spec, plain = bucket.spec_rate(), bucket.plain_rate()
        if spec is None or plain is None:
            return spec is None                 # measure what is not measured yet, speculation first
        if bucket.speculating and spec < LEAVE * plain or not bucket.speculating and spec > RETURN * plain:
            bucket.speculating, bucket.since_other = not bucket.speculating, 0
        if bucket.since_other >= EXPLORE_EVERY:
            return not bucket.speculating
        return bucket.speculating

    def settled_plain(self, rows: int) -> bool:
        """Has the bucket of `rows` chosen plain decoding on both modes' measurements (not merely not
        measured speculation yet, nor exploring plain steps from a speculating bucket)?"""
        bucket = self.buckets[bucket_of(rows)]
        return not bucket.speculating and bucket.spec_rate() is not None and bucket.plain_rate() is not None

    def skip_prompts(self, rows: int) -> bool:
        """Greedy prompts arrive while `rows` requests run: may the draft skip them (their requests will
        decode plainly)? Where the bucket is settled on plain, except when it is due to explore: then the
        prompts are read and their requests' first decode launch speculates. Counts as a launch fed plain."""
        bucket = self.buckets[bucket_of(max(rows, 1))]
        if not self.settled_plain(max(rows, 1)) or bucket.since_other >= EXPLORE_EVERY:
            return False
        bucket.since_other += 1
        return True

    def fed(self, rows: int, speculative: bool) -> None:
        """A decode launch of `rows` all-greedy requests was fed in this mode."""
        bucket = self.buckets[bucket_of(rows)]
        if speculative == bucket.speculating:
            bucket.since_other += 1
        else:
            self.explorations += bucket.since_other >= EXPLORE_EVERY
            bucket.since_other = 0

    def observe(self, rows: int, speculative: bool, seconds: float, steps: int, tokens: int = 0) -> None:
        """A decode launch of `rows` all-greedy requests ran `steps` steps (rounds) in `seconds` of
        device time; speculative: its rows emitted `tokens` in all."""
        if rows < 1 or steps < 1 or seconds <= 0:
            return
        bucket = self.buckets[bucket_of(rows)]
        per_row = seconds / (steps * rows)
        if not speculative:
            bucket.plain_seconds.append(per_row)
            return
        bucket.spec_seconds.append(per_row)
        per_round = tokens / (steps * rows)
        old = bucket.tokens_per_round
        bucket.tokens_per_round = per_round if not old else old + ACCEPT_WEIGHT * (per_round - old)

    def estimates(self) -> list[Estimate]:
        """Every bucket that measured something."""
        return [Estimate(bucket_label(i), b.spec_rate() or 0.0, b.plain_rate() or 0.0, b.speculating)
                for i, b in enumerate(self.buckets) if b.spec_seconds or b.plain_seconds]

    @staticmethod
    def describe() -> str:
        """For the start-up log line."""
        labels = ", ".join(bucket_label(i) for i in range(len(BUCKETS)))
        return (f"adaptive: per batch size ({labels} requests), greedy batches decode plainly where "
                f"speculation is expected to lose (below {LEAVE:g}x plain's rate, back above {RETURN:g}x), "
                f"each mode measured as it serves, the other tried one launch in {EXPLORE_EVERY}")
