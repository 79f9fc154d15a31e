"""Turns a ScheduledBatch into device work: update the request->slot table, resolve
future inputs, run the model over the paged cache, sample, store into the future
map and copy the sampled tokens to the host. Everything after `prepare` runs on the
rank's stream; the CPU only builds small host tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from devices.base import Device, Launched
from engine.args import ServerArgs
from engine.future_map import FutureMap
from engine.models.attention import KVCache, build_attention_batch
from engine.models.loader import load_model
from engine.sampling import SamplingBatch, sample, token_logprobs
from engine.scheduler import ScheduledBatch, StepOutput

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
        layers, kv_heads, head_dim = self.model.kv_layout()
        self.num_slots = self.kv_capacity(KVCache.bytes_per_slot(layers, kv_heads, head_dim, self.dtype))
        dev = device.torch_device
        self.kv = KVCache.allocate(layers, self.num_slots, kv_heads, head_dim, self.dtype, dev)
        self.req_to_slot = torch.zeros(self.num_rows, self.context_length, dtype=torch.long, device=dev)
        self.futures = FutureMap(future_slots, dev)
        self.generator = torch.Generator(device=dev).manual_seed(args.random_seed)
        log.info("loaded %s (%s, %s) on %s; KV cache: %d tokens, context %d",
                 Path(args.model_path).name, self.hf_config.architectures[0], self.dtype, dev,
                 self.num_slots, self.context_length)

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
        table_rows, table_pos, q_lens, kv_lens, rows, sample_rows, future_ids, positions = [], [], [], [], [], [], [], []
        offset = 0
        for seq in batch.seqs:
            end = seq.start + seq.q_len
            table_rows.extend([seq.row] * seq.q_len)
            table_pos.extend(range(seq.start, end))
            q_lens.append(seq.q_len)
            kv_lens.append(end)
            rows.append(seq.row)
            offset += seq.q_len
            if seq.samples:
                sample_rows.append(offset - 1)
                future_ids.append(seq.future_id)
                positions.append(end)
        long = dict(dtype=torch.long)
        return BatchInputs(
            input_ids=torch.tensor(batch.input_ids, **long), table_rows=torch.tensor(table_rows, **long),
            table_pos=torch.tensor(table_pos, **long), table_slots=torch.tensor(batch.write_slots, **long),
            q_lens=torch.tensor(q_lens, **long), kv_lens=torch.tensor(kv_lens, **long),
            rows=torch.tensor(rows, **long), sample_rows=torch.tensor(sample_rows, **long),
            future_ids=torch.tensor(future_ids, **long), max_q=batch.max_q, max_kv=batch.max_kv,
            sampling=SamplingBatch.build(batch.sample_params, positions, self.vocab_size, torch.device("cpu")))

    def launch(self, batch: ScheduledBatch) -> Launched:
        inputs = self.prepare(batch)
        return self.device.launch(lambda: self.forward_and_sample(inputs))

    # ---- on the stream -------------------------------------------------------------

    def forward_and_sample(self, inp: BatchInputs) -> tuple:
        dev = self.device.torch_device
        put = lambda t: t.to(dev, non_blocking=True)
        self.req_to_slot[put(inp.table_rows), put(inp.table_pos)] = put(inp.table_slots)
        input_ids = self.futures.resolve(put(inp.input_ids))
        attn = build_attention_batch(put(inp.q_lens), put(inp.kv_lens), put(inp.rows), self.req_to_slot,
                                     inp.max_q, inp.max_kv, self.kv)
        hidden = self.model(input_ids, attn).hidden
        if inp.sample_rows.numel() == 0:
            return ()
        logits = self.model.compute_logits(hidden[put(inp.sample_rows)])
        tokens = sample(logits, to_device(inp.sampling, dev), self.generator)
        self.futures.store(put(inp.future_ids), tokens)
        host = lambda t: t.to("cpu", non_blocking=True)
        if inp.sampling.max_logprobs is None:
            return (host(tokens),)
        chosen, values, ids = token_logprobs(logits, tokens, inp.sampling.max_logprobs)
        return host(tokens), host(chosen), host(values), host(ids)

    @staticmethod
    def output(result: tuple) -> StepOutput:
        """Host lists from a finished batch's tensors (called after its event fired)."""
        if not result:
            return StepOutput(tokens=[])
        out = StepOutput(tokens=result[0].tolist())
        if len(result) > 1:
            out.logprobs = result[1].tolist()
            out.top_logprobs = [list(zip(i, v)) for i, v in zip(result[3].tolist(), result[2].tolist())]
        return out


def to_device(sb: SamplingBatch, dev: torch.device) -> SamplingBatch:
    if dev.type == "cpu":
        return sb
    move = {k: getattr(sb, k).to(dev, non_blocking=True) for k in ("temperature", "top_k", "top_p", "min_p", "greedy")}
    return SamplingBatch(**{**sb.__dict__, **move})
