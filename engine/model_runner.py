"""Turns a ScheduledBatch into device work: update the request->slot table, resolve future
inputs, run the model over the paged cache, sample, store into the future map and copy the
sampled tokens to the host. What a way of decoding adds (speculation: a draft's KV, draft/verify
steps, the draft's reads of prompts) is the runner's decoding (engine/decoding.py), which sees the
target only through a narrow handle (engine/step.py: Target). Everything after `prepare` runs on
the rank's stream; the CPU only builds small host tensors.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Callable

import torch

from devices.base import Deferred, Device, Launched
from devices.cpu_native import describe_cpu_path
from devices.graphs import GraphRunner, graph_settings
from engine.args import ServerArgs
from engine.batch import ScheduledBatch
from engine.decoding import Decoding, create_decoding
from engine.faults import FaultInjector
from engine.future_map import FutureMap
from engine.grammar_masks import leave_pending, mask_rows
from engine.graph_shape import GraphShape
from engine.models.attention import KVCache, attention_groups, build_attention_batch, padded_width
from engine.dp import DpGroup
from engine.models.loader import load_model, resolve_dtype
from engine.models.moe import shard_experts
from engine.sampling import SamplingBatch, sample
from engine.step import RequestState, StepInputs, StepResult, Target, step_result
from engine.target_graphs import TargetGraphs

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 65536


class ModelRunner:
    def __init__(self, args: ServerArgs, device: Device, future_slots: int, dp: DpGroup | None = None):
        self.args, self.device = args, device
        self.dtype = resolve_dtype(args.dtype, device.torch_device, args.cpu_kernels, args.quantization)
        self.model, self.hf_config = load_model(args.model_path, self.dtype, device.torch_device, args.cpu_kernels,
                                                args.quantization)
        if dp is not None and not shard_experts(self.model, dp):
            raise ValueError(f"--enable-dp-attention: {args.model_path} has no MoE layers to split over the ranks")
        self.context_length = args.context_length or self.hf_config.max_position_embeddings
        self.spec_tokens = args.num_steps + 1 if args.num_steps else 0
        # Speculative steps may write up to two steps (2 * (k+1) positions) past the committed length
        # (in whole pages: attention reads the table a page at a time).
        table_width = padded_width(self.context_length + 2 * self.spec_tokens + 1, args.page_size)
        dev = device.torch_device
        self.futures = FutureMap(future_slots, dev)
        self.target = Target(model=self.model, device=device, dtype=self.dtype, vocab_size=self.hf_config.vocab_size,
                             num_rows=args.max_running_requests, table_width=table_width, page_size=args.page_size,
                             generator=torch.Generator(device=dev).manual_seed(args.random_seed),
                             futures=self.futures, dp_attention=dp is not None)
        self.faults = FaultInjector.from_env()      # a test hook; None unless TANDEM_FAULT_INJECT is set
        settings = graph_settings(device.name, args.disable_cuda_graph, args.enable_cpu_graph, args.cuda_graph_bs,
                                  args.cuda_graph_max_bs, args.max_running_requests, dev)
        self.target.graphs = TargetGraphs(settings, self.target, args.num_steps, dp) if settings else None
        self.decoding: Decoding = create_decoding(args, self.target)
        if self.graphs:
            self.graphs.capture_aux = self.decoding.needs_aux
        self.allocate_kv()
        log.info("loaded %s (%s, %s%s) on %s; KV cache: %d tokens, context %d; speculation: %s",
                 Path(args.model_path).name, self.hf_config.architectures[0], self.dtype,
                 f", {args.quantization} weights" if args.quantization else "", dev,
                 self.num_slots, self.context_length, self.decoding.describe())
        if dev.type == "cpu":
            log.info("CPU path: %s; dtype %s%s", describe_cpu_path(self.model, device.threads or None),
                     str(self.dtype).removeprefix("torch."),
                     " (--dtype auto: devices/cpu_native.py auto_cpu_dtype)" if args.dtype == "auto" else "")
        log.info("graphs: %s", settings.describe() if settings else self.graphs_off_reason())

    @property
    def graphs(self) -> TargetGraphs | None:
        return self.target.graphs

    def graphs_off_reason(self) -> str:
        if self.args.disable_cuda_graph:
            return "off (--disable-cuda-graph)"
        if self.device.name == "cpu" and not self.args.enable_cpu_graph:
            return "off (the CPU runs steps eagerly; --enable-cpu-graph runs its graph path)"
        return "off (no capture size up to --cuda-graph-max-bs / --max-running-requests)"

    @property
    def num_rows(self) -> int:
        return self.target.num_rows

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def kv(self) -> KVCache:
        return self.target.kv

    @property
    def req_to_slot(self) -> torch.Tensor:
        return self.target.req_to_slot

    def allocate_kv(self) -> None:
        """Size the KV cache (the target's and the decoding's share slots), then allocate it and the slot table.

        Past the num_slots the KV pool hands out, the caches hold one more page, the padding page, and
        the slot table one more row, the padding row (Target.pad_row), whose every position maps into
        that page: padded rows of a captured step write there and nowhere else (no request owns it)."""
        layers, kv_heads, head_dim = self.model.kv_layout()
        per_slot = KVCache.bytes_per_slot(layers, kv_heads, head_dim, self.dtype)
        self.num_slots = self.kv_capacity(per_slot + self.decoding.kv_bytes_per_slot())
        dev, target, page = self.device.torch_device, self.target, self.args.page_size
        pad_page = self.num_slots // page                      # KVPool's pages are 0 .. num_slots // page - 1
        cache_slots = (pad_page + 1) * page
        target.kv = KVCache.allocate(layers, cache_slots, kv_heads, head_dim, self.dtype, dev, page)
        target.req_to_slot = torch.zeros(target.num_rows + 1, target.table_width, dtype=torch.long, device=dev)
        target.req_to_slot[target.pad_row] = pad_page * page + torch.arange(target.table_width, device=dev) % page
        self.decoding.allocate_kv(cache_slots)

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

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        q_lens = [seq.q_len for seq in batch.seqs]
        kv_lens = [seq.start + seq.q_len for seq in batch.seqs]
        sample_rows, future_ids, noise_keys = sampling_rows(batch)
        long = long_tensor
        return StepInputs(
            input_ids=long(batch.input_ids), q_lens=long(q_lens), kv_lens=long(kv_lens),
            rows=long([seq.row for seq in batch.seqs]), sample_rows=long(sample_rows), future_ids=long(future_ids),
            max_q=batch.max_q, max_kv=batch.max_kv,
            sampling=SamplingBatch.build(batch.sample_params, noise_keys, self.vocab_size, torch.device("cpu"),
                                         [seq.req.grammar for seq in batch.sampling]),
            spec=self.decoding.plan_inputs(batch), steps=batch.steps,
            groups=attention_groups(q_lens, kv_lens, "cpu") if not batch.is_spec_decode else None)

    def graph_shape(self, batch: ScheduledBatch | None) -> GraphShape | None:
        """The captured graph the batch's target forward could replay (None: it runs eagerly): a
        speculative step's verify, or a batch of plain decodes only where nothing else reads their forward."""
        graphs = self.graphs
        if graphs is None or batch is None or batch.idle or batch.steps > 1 or \
                graphs.settings.size_for(len(batch.seqs)) is None:
            return None
        width = self.target.key_width(batch.max_kv)
        if batch.is_spec_decode:
            return GraphShape("verify", len(batch.seqs), batch.chain, width)
        plain_decodes = all(seq.decode and seq.q_len == 1 and seq.samples for seq in batch.seqs)
        if plain_decodes and self.decoding.plain_decode_graphs:
            return GraphShape("decode", len(batch.seqs), 0, width)
        return None

    def launch(self, batch: ScheduledBatch, graph: GraphShape | None = None) -> Launched:
        """The batch on the stream; `graph`: the captured graph its target forward replays (graph_shape,
        or what a DP-attention group agreed), None: eagerly.

        What the batch launched behind this one was planned on lands on the stream whatever becomes
        of this step (preparing it raises, its work fails, or it does not run): its rows of a request
        that this step fails still run, and must stay inside that request's own slots (freed, and
        reused only by work queued after). Hence `bookkeeping` runs first, always."""
        bookkeeping = self.bookkeeping(batch)
        try:
            inputs = self.prepare(batch)
            inputs.graph = graph
            work = functools.partial(self.run_step, inputs)
            if self.faults:
                work = self.faults.wrap(batch, work)
        except Exception as exc:       # delivered to whoever awaits the launch, after the bookkeeping
            work = functools.partial(reraise, exc)
        return self.device.launch(work, always=bookkeeping)

    def bookkeeping(self, batch: ScheduledBatch) -> Callable[[], None]:
        """On the stream: the slot-table entries of the pages this batch allocated (else the rows
        read stale entries: a neighbour's slots), then the decoding's (speculation: each completed
        prompt's length)."""
        long, dev = long_tensor, self.device.torch_device
        entries = (long(batch.table_rows), long(batch.table_pos), long(batch.table_slots)) if batch.table_rows else None
        decoding = self.decoding.bookkeeping(batch)

        def write() -> None:
            if entries:
                rows, pos, slots = entries
                self.req_to_slot[rows.to(dev), pos.to(dev)] = slots.to(dev)
            decoding()
        return write

    # ---- on the stream -------------------------------------------------------------

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of the step's inputs on the device, without waiting."""
        return tensor.to(self.device.torch_device, non_blocking=True)

    def run_step(self, inp: StepInputs) -> StepResult | Deferred:
        """On the stream: the decoding's step (a speculative one, or the target's forward_and_sample)."""
        return self.decoding.run(self.sampling_on_device(inp), self.forward_and_sample)

    def forward_and_sample(self, inp: StepInputs) -> StepResult | Deferred:
        """The target's forward and sampling of a batch of prompt chunks and plain decodes; the
        decoding then does what it adds after such a batch (Decoding.after_forward)."""
        if inp.steps > 1:
            return self.decode_steps(inp)
        put = self.put
        input_ids = self.futures.resolve(put(inp.input_ids))
        if inp.graph is not None:
            logits = self.graphs.decode_logits(inp.graph, input_ids, put(inp.kv_lens) - 1, put(inp.rows))
            return self.sample_rows(inp, logits)[0]
        groups = inp.groups and [group._replace(seqs=put(group.seqs)) for group in inp.groups]
        attn = build_attention_batch(put(inp.q_lens), put(inp.kv_lens), put(inp.rows), self.req_to_slot,
                                     inp.max_q, inp.max_kv, self.kv, groups=groups, tokens=input_ids.shape[0])
        out = self.model(input_ids, attn, capture_aux=self.decoding.capture_aux(inp))
        if inp.sample_rows.numel() == 0:
            return self.decoding.after_forward(inp, input_ids, attn, out, input_ids[:0], StepResult())
        logits = self.model.compute_logits(out.hidden[put(inp.sample_rows)])
        result, tokens = self.sample_rows(inp, logits)
        return self.decoding.after_forward(inp, input_ids, attn, out, tokens, result)

    def sampling_on_device(self, inp: StepInputs) -> StepInputs:
        """On the stream: the step's sampling parameters where its logits are (the draft's and the
        verify's sampling read them too)."""
        sampling = to_device(inp.sampling, self.device.torch_device)
        return inp if sampling is inp.sampling else dataclasses.replace(inp, sampling=sampling)

    def decode_steps(self, inp: StepInputs) -> StepResult:
        """inp.steps plain decode steps of a batch of decodes (one token each) back to back: each
        row feeds the token it sampled last, at the next position, with the next noise key. Where
        the decoding reads such a batch (a draft), it then reads the run (Decoding.read_run)."""
        put = self.put
        input_ids = self.futures.resolve(put(inp.input_ids))
        q_lens, kv_lens, rows = put(inp.q_lens), put(inp.kv_lens), put(inp.rows)
        sb = to_device(inp.sampling, self.device.torch_device)
        reads = self.decoding.reads_prompt(inp)
        aux = reads and self.decoding.capture_aux(inp)
        fed, outs, tokens, logits = [], [], [], []
        for step in range(inp.steps):
            attn = build_attention_batch(q_lens, kv_lens + step, rows, self.req_to_slot, 1, inp.max_kv + step, self.kv,
                                         tokens=rows.shape[0])
            out = self.model(input_ids, attn, capture_aux=aux)
            step_logits = self.model.compute_logits(out.hidden)
            if reads:
                fed.append(input_ids)
                outs.append(out)
            mask_rows(step_logits, sb.grammars)
            input_ids = sample(step_logits, sb.advanced(step), self.target.generator)
            leave_pending(input_ids, sb.grammars)
            tokens.append(input_ids)
            logits.append(step_logits)
        self.futures.store(put(inp.future_ids), input_ids)
        if reads:
            self.decoding.read_run(inp, torch.stack(fed, dim=1), outs, input_ids)
        emitted = torch.stack(tokens, dim=1)
        every = torch.stack(logits, dim=1) if sb.max_logprobs is not None else None
        return step_result(emitted, torch.full_like(input_ids, inp.steps - 1), every, sb)

    def sample_rows(self, inp: StepInputs, logits: torch.Tensor) -> tuple[StepResult, torch.Tensor]:
        """A token from each sampling sequence's logits, stored in its future: the result and the tokens."""
        sb = to_device(inp.sampling, self.device.torch_device)
        mask_rows(logits, sb.grammars)
        tokens = sample(logits, sb, self.target.generator)
        leave_pending(tokens, sb.grammars)
        self.futures.store(self.put(inp.future_ids), tokens)
        return step_result(tokens[:, None], torch.zeros_like(tokens), logits[:, None], sb), tokens

    def idle_step(self, decode: bool, graph: GraphShape | None = None) -> StepResult:
        """On the stream: a step with no rows that makes the same sequence of model calls as a real
        one (a prefill batch, or a decode step: the decoding's whole sequence), so that a rank with
        no work can join the collectives of the others; with `graph` (what the group agreed), a
        replay of that graph with padding only."""
        if graph is not None:
            self.graphs.idle(graph)
            return StepResult()
        result = self.decoding.idle_step(decode, self.forward_and_sample)
        return result.result if isinstance(result, Deferred) else result

    # ---- a request's state, to continue elsewhere (on the stream) --------------------

    def export_chunk(self, row: int | None, slots: list[int]) -> tuple[list, list, dict]:
        """The KV of the given slots, the draft's too, and (given a row) the row's draft state."""
        index = self.slot_index(slots)
        draft_row = self.decoding.export_row(row) if row is not None else {}
        return self.kv.read_slots(index), self.decoding.read_draft_kv(index), draft_row

    def import_state(self, row: int, slots: list[int], state: RequestState, token_ids: list[int]) -> None:
        """Write an exported request into `row`, whose positions 0..len(slots)-1 have `slots`."""
        index = self.slot_index(slots[:state.kv_len])
        self.kv.write_slots(index, state.target_kv)
        self.decoding.write_draft_kv(index, state.draft_kv)
        self.activate_row(row, slots, state.draft_row, token_ids, state.kv_len)

    def write_kv_layer(self, slots: list[int], layer: int, kind: str, pair: torch.Tensor) -> None:
        """One layer's K and V [2, n, kv_heads, head_dim] of some positions of a request, arriving
        from a prefill node, into their slots."""
        cache = self.kv if kind == "target" else self.decoding.draft_kv
        if cache is None or not 0 <= layer < len(cache.k) or tuple(pair.shape[2:]) != tuple(cache.k[0].shape[1:]) \
                or pair.shape[:2] != (2, len(slots)):
            raise ValueError(f"a {kind} KV block of shape {list(pair.shape)} for layer {layer} does not fit this cache")
        index = self.slot_index(slots)
        cache.k[layer].index_copy_(0, index, pair[0].to(cache.k[layer].device, cache.k[layer].dtype))
        cache.v[layer].index_copy_(0, index, pair[1].to(cache.v[layer].device, cache.v[layer].dtype))

    def activate_row(self, row: int, slots: list[int], draft_row: dict, token_ids: list[int], kv_len: int) -> None:
        """A request whose KV is in place starts decoding in `row`: its slot table, and the decoding's
        per-row state (speculation: the bonus is its token at kv_len)."""
        self.req_to_slot[row, :len(slots)] = self.slot_index(slots)
        self.decoding.import_row(row, draft_row, token_ids, kv_len)

    def slot_index(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.device.torch_device)

    # ---- graphs ---------------------------------------------------------------------------

    def graph_runners(self) -> list[GraphRunner]:
        """Every graph runner made so far: the target's and the decoding's (a draft's)."""
        runners = self.graphs.runners() if self.graphs else []
        return runners + self.decoding.graph_runners()

    def release_graphs(self) -> None:
        """Release every captured graph (on the stream: nothing in flight may replay them)."""
        for runner in self.graph_runners():
            runner.release_all()

    def phase_times(self, result: StepResult) -> list[tuple[str, float]]:
        """(phase, device seconds) of a finished speculative step, from the marks it recorded."""
        marks, device = result.marks, self.device
        return [(name, device.seconds_between(prev, cur)) for (_, prev), (name, cur) in zip(marks, marks[1:])]


def reraise(exc: Exception) -> None:
    """Launched work that fails with what preparing the step raised."""
    raise exc


def long_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def sampling_rows(batch: ScheduledBatch) -> tuple[list[int], list[int], list[int]]:
    """Of each sampling sequence: its last token's index among the batch's tokens, its future slot
    and its noise key."""
    rows, futures, keys, offset = [], [], [], 0
    for seq in batch.seqs:
        offset += seq.q_len
        if seq.samples:
            rows.append(offset - 1)
            futures.append(seq.future_id)
            keys.append(seq.noise_key)
    return rows, futures, keys


def to_device(sb: SamplingBatch, dev: torch.device) -> SamplingBatch:
    if dev == torch.device("cpu"):
        return sb
    move = {k: getattr(sb, k).to(dev, non_blocking=True) for k in ("temperature", "top_k", "top_p", "min_p", "greedy")}
    return SamplingBatch(**{**sb.__dict__, **move})
