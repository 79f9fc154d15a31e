"""The draft worker's captured steps (devices/graphs.py): EAGLE's chain of draft steps and its
draft-extend, and a standalone draft model's chain (its catch-up read included). Each is keyed by
(chain length k, key width); padded rows read and write only the slot table's padding row
(Target.pad_row) and its padding page.

Captured chains are greedy and whole: a batch with sampling rows, or (standalone) a draft that lags
behind after plain steps, drafts eagerly; the verify and the extend do not depend on either.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from devices.graphs import GraphRunner, Static
from engine.fixed_batches import fixed_attention_batch
from engine.graph_shape import key_widths
from engine.models.attention import chain_step_batch

if TYPE_CHECKING:
    from spec.eagle_worker import EagleWorker
    from spec.standalone_worker import StandaloneWorker


def planned_widths(worker) -> list[int]:
    """The key widths a worker's captured steps may read (engine/graph_shape.py key_width)."""
    return key_widths(worker.target.page_size, worker.target.table_width)


def row_inputs(worker) -> dict[str, Static]:
    """Every captured draft step reads its rows' first position and slot-table row."""
    return {"first_pos": Static((), torch.long), "rows": Static((), torch.long, pad=worker.target.pad_row)}


class EagleGraphs:
    """draft: d_2..d_k from d_1 and the head's state g (k-1 head forwards); extend: the head over the
    k+1 verified tokens of each row, its output at the last accepted one."""

    def __init__(self, worker: "EagleWorker"):
        self.worker = worker
        target, k = worker.target, worker.args.num_steps
        settings, hidden, dtype = target.graphs.settings, worker.head.hidden_size, target.dtype
        features = target.model.hidden_size * (len(target.model.aux_layer_ids) if worker.needs_aux else 1)
        self.draft: GraphRunner = settings.runner(
            "eagle-draft", self.draft_step,
            {"first": Static((), torch.long), "hidden": Static((hidden,), dtype), **row_inputs(worker)},
            {"drafts": Static((k,), torch.long)})
        self.extend: GraphRunner = settings.runner(
            "eagle-extend", self.extend_step,
            {"tokens": Static((k + 1,), torch.long), "features": Static((k + 1, features), dtype),
             "accepted": Static((), torch.long), **row_inputs(worker)},
            {"hidden": Static((hidden,), dtype)})

    def runners(self) -> list[GraphRunner]:
        return [self.draft, self.extend]

    def planned(self) -> list[tuple[GraphRunner, dict]]:
        """For capture at start-up: chains of 2..k drafts (an all-greedy batch near its end drafts fewer),
        extends after verifies of 0..k drafts, at every key width."""
        worker, widths = self.worker, planned_widths(self.worker)
        k, hidden = worker.args.num_steps, worker.head.hidden_size
        features = self.extend.static_in["features"].shape[-1]
        rows = {"first_pos": (), "rows": ()}
        draft = {(chain, width): {"first": (), "hidden": (hidden,), **rows} for chain in range(2, k + 1)
                 for width in widths}
        extend = {(chain, width): {"tokens": (chain + 1,), "features": (chain + 1, features), "accepted": (), **rows}
                  for chain in range(k + 1) for width in widths}
        return [(self.draft, draft), (self.extend, extend)]

    def draft_step(self, key: tuple[int, int], first, hidden, first_pos, rows) -> dict[str, torch.Tensor]:
        k, width = key
        worker = self.worker
        table = worker.target.req_to_slot[:, :width].index_select(0, rows)
        drafts, g = [first], hidden
        for i in range(2, k + 1):
            g = worker.head(drafts[-1], g, chain_step_batch(first_pos + (i - 2), table, worker.draft_kv))
            drafts.append(worker.propose_greedy(g))
        return {"drafts": torch.stack(drafts, dim=1)}

    def extend_step(self, key: tuple[int, int], tokens, features, accepted, first_pos, rows) -> dict[str, torch.Tensor]:
        _, width = key
        worker = self.worker
        batch, per_row = tokens.shape
        attn = fixed_attention_batch(first_pos, per_row, rows, worker.target.req_to_slot, width, worker.draft_kv)
        g_all = worker.head(tokens.reshape(-1), features.reshape(batch * per_row, -1), attn)
        return {"hidden": g_all.view(batch, per_row, -1)[torch.arange(batch, device=rows.device), accepted]}


class StandaloneGraphs:
    """draft: the draft model reads positions L-1, L of each row (no lag) and proposes d_1, then reads
    each draft in turn (k forwards in all)."""

    def __init__(self, worker: "StandaloneWorker"):
        self.worker = worker
        target, k = worker.target, worker.args.num_steps
        inputs = {"recent": Static((2,), torch.long), **row_inputs(worker)}
        inputs["first_pos"] = Static((), torch.long, pad=1)         # a padded row reads positions 0 and 1
        self.draft: GraphRunner = target.graphs.settings.runner("standalone-draft", self.draft_step, inputs,
                                                                {"drafts": Static((k,), torch.long)})

    def runners(self) -> list[GraphRunner]:
        return [self.draft]

    def planned(self) -> list[tuple[GraphRunner, dict]]:
        """For capture at start-up: chains of 1..k drafts, at every key width."""
        keys = {(chain, width): {"recent": (2,), "first_pos": (), "rows": ()}
                for chain in range(1, self.worker.args.num_steps + 1) for width in planned_widths(self.worker)}
        return [(self.draft, keys)]

    def draft_step(self, key: tuple[int, int], recent, first_pos, rows) -> dict[str, torch.Tensor]:
        k, width = key
        worker, req_to_slot = self.worker, self.worker.target.req_to_slot
        batch = rows.shape[0]
        attn = fixed_attention_batch(first_pos - 1, 2, rows, req_to_slot, width, worker.draft_kv)
        hidden = worker.draft_model(recent.reshape(-1), attn).hidden.view(batch, 2, -1)[:, 1]
        drafts = [worker.propose_greedy(hidden)]
        table = req_to_slot[:, :width].index_select(0, rows)
        for i in range(2, k + 1):
            attn = chain_step_batch(first_pos + (i - 1), table, worker.draft_kv)
            drafts.append(worker.propose_greedy(worker.draft_model(drafts[-1], attn).hidden))
        return {"drafts": torch.stack(drafts, dim=1)}
