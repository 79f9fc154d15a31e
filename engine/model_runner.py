"""Turns a ScheduledBatch into device work: update the request->slot table, resolve
future inputs, run the model over the paged cache, sample, store into the future
map and copy the sampled tokens to the host. Everything after `prepare` runs on the
rank's stream; the CPU only builds small host tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from devices.base import Deferred, Device, Launched
from engine.args import ServerArgs
from engine.faults import FaultInjector
from engine.future_map import FutureMap
from engine.models.attention import KVCache, attention_groups, build_attention_batch, padded_width
from engine.models.loader import load_model
from engine.sampling import SamplingBatch, sample, token_logprobs
from engine.scheduler import ScheduledBatch, StepOutput
from spec.base import create_spec_worker

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 65536
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BatchInputs:
    """Host tensors of one batch; kept referenced until its work has run."""
    input_ids: torch.Tensor
    table_rows: torch.Tensor
    table_pos: torch.Tensor
    table_slots: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    rows: torch.Tensor
    sample_rows: torch.Tensor      # index of each sampling sequence's last token among the T tokens
    future_ids: torch.Tensor
    max_q: int
    max_kv: int
    sampling: SamplingBatch
    draft_next: torch.Tensor       # speculation, prefill: the token after each chunk (-1: the sampled one)
    spec_decode: bool
    chain: int                     # speculative decode: draft tokens per request (0: a plain step under load)
    draft_lag: torch.Tensor        # speculative decode: tokens each request's draft model has not read yet
    draft_skip: bool = False       # speculation, prefill: the draft model does not read this batch
    groups: list | None = None     # attention parts (host indices): decodes apart from prompt chunks


@dataclass
class StepResult:
    """What a launched step produced, as host tensors (read them once its launch resolved)."""
    emitted: torch.Tensor | None = None        # [B, R] tokens; row b's first accepted[b] + 1 count
    accepted: torch.Tensor | None = None       # [B] accepted drafts (0: one token)
    logprobs: torch.Tensor | None = None       # [B, R] of the emitted tokens, when a row asked
    top_values: torch.Tensor | None = None     # [B, R, top]
    top_ids: torch.Tensor | None = None
    marks: list = field(default_factory=list)  # speculative steps: (phase, device mark), "start" first


def resolve_dtype(name: str, device: Device) -> torch.dtype:
    return device.default_dtype() if name == "auto" else DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs, device: Device, future_slots: int):
        self.args, self.device = args, device
        self.dtype = resolve_dtype(args.dtype, device)
        self.model, self.hf_config = load_model(args.model_path, self.dtype, device.torch_device)
        self.vocab_size = self.hf_config.vocab_size
        self.context_length = args.context_length or self.hf_config.max_position_embeddings
        self.num_rows = args.max_running_requests
        self.spec_tokens = args.num_steps + 1 if args.num_steps else 0
        # Speculative steps may write up to two steps (2 * (k+1) positions) past the committed length.
        # (in whole pages: attention reads the table a page at a time)
        self.table_width = padded_width(self.context_length + 2 * self.spec_tokens + 1, args.page_size)
        dev = device.torch_device
        self.generator = torch.Generator(device=dev).manual_seed(args.random_seed)
        self.futures = FutureMap(future_slots, dev)
        self.faults = FaultInjector.from_env()      # a test hook; None unless TANDEM_FAULT_INJECT is set
        self.spec = create_spec_worker(args.spec_algorithm, self) if self.spec_tokens else None  # loads the draft
        self.draft_skips_prefill = bool(self.spec and self.spec.catches_up)
        layers, kv_heads, head_dim = self.model.kv_layout()
        per_slot = KVCache.bytes_per_slot(layers, kv_heads, head_dim, self.dtype)
        self.num_slots = self.kv_capacity(per_slot + (self.spec.kv_bytes_per_slot() if self.spec else 0))
        self.kv = KVCache.allocate(layers, self.num_slots, kv_heads, head_dim, self.dtype, dev, args.page_size)
        self.req_to_slot = torch.zeros(self.num_rows, self.table_width, dtype=torch.long, device=dev)
        if self.spec:
            self.spec.allocate_kv(self.num_slots)
        log.info("loaded %s (%s, %s) on %s; KV cache: %d tokens, context %d; speculation: %s",
                 Path(args.model_path).name, self.hf_config.architectures[0], self.dtype, dev,
                 self.num_slots, self.context_length,
                 self.spec.describe() if self.spec else "off")

    def kv_capacity(self, bytes_per_slot: int) -> int:
        args = self.args
        if args.max_total_tokens:
            return args.max_total_tokens
        stats = self.device.memory_stats()
        if stats is None:
            return CPU_DEFAULT_KV_TOKENS
        free, total = stats
        budget = free - total * (1.0 - args.mem_fraction_static)
        if budget <= bytes_per_slot * args.page_size:
            raise RuntimeError(f"no device memory left for the KV cache (free {free >> 20} MiB); "
                               f"raise --mem-fraction-static or set --max-total-tokens")
        return int(budget // bytes_per_slot)

    # ---- CPU side ------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> BatchInputs:
        q_lens, kv_lens, rows, sample_rows, future_ids, positions, lags = [], [], [], [], [], [], []
        offset = 0
        for seq in batch.seqs:
            end = seq.start + seq.q_len
            q_lens.append(seq.q_len)
            kv_lens.append(end)
            rows.append(seq.row)
            lags.append(seq.draft_lag)
            offset += seq.q_len
            if seq.samples:
                sample_rows.append(offset - 1)
                future_ids.append(seq.future_id)
                positions.append(seq.noise_key)
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        return BatchInputs(
            input_ids=long(batch.input_ids), table_rows=long(batch.table_rows), table_pos=long(batch.table_pos),
            table_slots=long(batch.table_slots), q_lens=long(q_lens), kv_lens=long(kv_lens), rows=long(rows),
            sample_rows=long(sample_rows), future_ids=long(future_ids), max_q=batch.max_q, max_kv=batch.max_kv,
            sampling=SamplingBatch.build(batch.sample_params, positions, self.vocab_size, torch.device("cpu")),
            draft_next=long(batch.draft_next), spec_decode=batch.is_spec_decode, chain=batch.chain,
            draft_lag=long(lags), draft_skip=batch.draft_skip,
            groups=attention_groups(q_lens, kv_lens, "cpu") if not batch.is_spec_decode else None)

    def launch(self, batch: ScheduledBatch) -> Launched:
        inputs = self.prepare(batch)
        if inputs.spec_decode:
            work = lambda: self.speculative_step(inputs)  # noqa: E731
        else:
            work = lambda: self.forward_and_sample(inputs)  # noqa: E731
        if self.faults:
            work = self.faults.wrap(batch, work)
        return self.device.launch(work)

    # ---- on the stream -------------------------------------------------------------

    def update_table(self, inp: BatchInputs) -> None:
        dev = self.device.torch_device
        if inp.table_rows.numel():
            self.req_to_slot[inp.table_rows.to(dev), inp.table_pos.to(dev)] = inp.table_slots.to(dev)

    def forward_and_sample(self, inp: BatchInputs) -> StepResult | Deferred:
        dev = self.device.torch_device
        put = lambda t: t.to(dev, non_blocking=True)  # noqa: E731
        self.update_table(inp)
        input_ids = self.futures.resolve(put(inp.input_ids))
        attn = build_attention_batch(put(inp.q_lens), put(inp.kv_lens), put(inp.rows), self.req_to_slot,
                                     inp.max_q, inp.max_kv, self.kv, groups=inp.groups and [
                                         (put(seqs), max_q, max_k) for seqs, max_q, max_k in inp.groups])
        out = self.model(input_ids, attn, capture_aux=self.spec is not None and self.spec.needs_aux)
        if inp.sample_rows.numel() == 0:
            if self.spec:
                self.spec.after_prefill(inp, input_ids, attn, out, input_ids[:0])
            return StepResult()
        logits = self.model.compute_logits(out.hidden[put(inp.sample_rows)])
        sb = to_device(inp.sampling, dev)
        tokens = sample(logits, sb, self.generator)
        self.futures.store(put(inp.future_ids), tokens)
        result = self.step_result(tokens[:, None], torch.zeros_like(tokens), logits[:, None], sb)
        if self.spec:       # the first tokens go out while the draft reads the prompt
            return Deferred(result, lambda: self.spec.after_prefill(inp, input_ids, attn, out, tokens))
        return result

    def speculative_step(self, inp: BatchInputs) -> StepResult:
        self.update_table(inp)
        result = self.spec.decode_step(inp)
        put = lambda t: t.to(self.device.torch_device, non_blocking=True)  # noqa: E731
        # each request's future: its last emitted token (the input of a plain decode that follows)
        self.futures.store(put(inp.future_ids), self.spec.bonus[put(inp.rows)])
        return result

    def step_result(self, emitted: torch.Tensor, n: torch.Tensor, logits: torch.Tensor, sb: SamplingBatch,
                    marks: list | None = None) -> StepResult:
        """Host copies of a step's outputs: emitted [B, R] tokens of which the first n+1 count,
        and, when asked, logprobs of the model's distribution at each of the R rows."""
        host = lambda t: t.to("cpu", non_blocking=True)  # noqa: E731
        result = StepResult(emitted=host(emitted), accepted=host(n), marks=marks or [])
        if sb.max_logprobs is not None:
            batch, rows = emitted.shape
            chosen, values, ids = token_logprobs(logits.reshape(batch * rows, -1), emitted.reshape(-1),
                                                 sb.max_logprobs)
            result.logprobs = host(chosen.view(batch, rows))
            result.top_values, result.top_ids = host(values.view(batch, rows, -1)), host(ids.view(batch, rows, -1))
        return result

    @staticmethod
    def output(result: StepResult) -> StepOutput:
        """Host lists from a finished batch's tensors (called after its event fired)."""
        if result.emitted is None:
            return StepOutput(tokens=[])
        counts = [n + 1 for n in result.accepted.tolist()]
        out = StepOutput(tokens=[row[:c] for row, c in zip(result.emitted.tolist(), counts)])
        if result.logprobs is not None:
            out.logprobs = [row[:c] for row, c in zip(result.logprobs.tolist(), counts)]
            out.top_logprobs = [[list(zip(i, v)) for i, v in zip(ids[:c], vals[:c])] for ids, vals, c in
                                zip(result.top_ids.tolist(), result.top_values.tolist(), counts)]
        return out

    def phase_times(self, result: StepResult) -> list[tuple[str, float]]:
        """(phase, device seconds) of a finished speculative step, from the marks it recorded."""
        marks, device = result.marks, self.device
        return [(name, device.seconds_between(prev, cur)) for (_, prev), (name, cur) in zip(marks, marks[1:])]


def to_device(sb: SamplingBatch, dev: torch.device) -> SamplingBatch:
    if dev.type == "cpu":
        return sb
    move = {k: getattr(sb, k).to(dev, non_blocking=True) for k in ("temperature", "top_k", "top_p", "min_p", "greedy")}
    return SamplingBatch(**{**sb.__dict__, **move})
