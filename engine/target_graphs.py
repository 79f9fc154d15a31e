"""The target's captured steps (devices/graphs.py): a plain decode (one token per row: the logits of
every row) and a speculative verify (chain + 1 tokens per row: the logits and hidden states of every
token). Sampling and acceptance stay outside the graphs.

Padded rows read and write only the slot table's padding row (`Target.pad_row`, whose positions all
map to the padding page no request owns), at positions from 0. Under DP attention the target forward
is a collective: every rank pads to the size the group agreed (engine/graph_shape.py), so each
forward's token counts are known to all ranks without an exchange (DpGroup.padded_forwards).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from devices.graphs import GraphRunner, GraphSettings, Static
from engine.fixed_batches import fixed_attention_batch
from engine.graph_shape import GraphShape, key_widths
from engine.models.base import ModelOutput

if TYPE_CHECKING:
    from engine.dp import DpGroup
    from engine.step import Target


class TargetGraphs:
    def __init__(self, settings: GraphSettings, target: "Target", max_chain: int, dp: "DpGroup | None"):
        self.settings, self.target, self.max_chain, self.dp = settings, target, max_chain, dp
        self.capture_aux = False            # the verify keeps the EAGLE-3 aux hidden states (set before any run)
        self.idle_replays = 0               # DP attention: replays with padding only (this rank had no batch)

    def inputs(self, tokens: int) -> dict[str, Static]:
        pad_row = self.target.pad_row
        return {"tokens": Static((tokens,), torch.long), "first_pos": Static((), torch.long),
                "rows": Static((), torch.long, pad=pad_row)}

    @functools.cached_property
    def decode(self) -> GraphRunner:
        outputs = {"logits": Static((self.target.vocab_size,), torch.float32)}
        return self.settings.runner("target-decode", self.decode_step, self.inputs(1), outputs,
                                    self.dp and self.dp.padded_forwards)

    @functools.cached_property
    def verify(self) -> GraphRunner:
        width, hidden = self.max_chain + 1, self.target.model.hidden_size
        outputs = {"logits": Static((width, self.target.vocab_size), torch.float32),
                   "hidden": Static((width, hidden), self.target.dtype)}
        if self.capture_aux:
            aux_width = len(self.target.model.aux_layer_ids) * hidden
            outputs["aux"] = Static((width, aux_width), self.target.dtype)
        return self.settings.runner("target-verify", self.verify_step, self.inputs(width), outputs,
                                    self.dp and self.dp.padded_forwards)

    def planned(self, speculative: bool) -> list[tuple[GraphRunner, dict]]:
        """What serving replays, for capture at start-up (GraphRunner.capture_ahead): plain decodes
        without a speculative worker, else verifies of every chain length up to max_chain (0: a
        plain step under load, fewer: an all-greedy batch near its end); at every key width."""
        widths = key_widths(self.target.page_size, self.target.table_width)
        rows = {"first_pos": (), "rows": ()}
        if not speculative:
            return [(self.decode, {width: {"tokens": (1,), **rows} for width in widths})]
        return [(self.verify, {(chain, width): {"tokens": (chain + 1,), **rows}
                               for chain in range(self.max_chain + 1) for width in widths})]

    # ---- the captured functions ----------------------------------------------------------

    def forward(self, tokens: torch.Tensor, first_pos: torch.Tensor, rows: torch.Tensor, width: int,
                capture_aux: bool) -> ModelOutput:
        target = self.target
        attn = fixed_attention_batch(first_pos, tokens.shape[1], rows, target.req_to_slot, width, target.kv)
        return target.model(tokens.reshape(-1), attn, capture_aux=capture_aux)

    def decode_step(self, width: int, tokens, first_pos, rows) -> dict[str, torch.Tensor]:
        out = self.forward(tokens, first_pos, rows, width, capture_aux=False)
        return {"logits": self.target.model.compute_logits(out.hidden)}

    def verify_step(self, key: tuple[int, int], tokens, first_pos, rows) -> dict[str, torch.Tensor]:
        _, width = key
        batch, per_row = tokens.shape
        out = self.forward(tokens, first_pos, rows, width, capture_aux=self.capture_aux)
        result = {"logits": self.target.model.compute_logits(out.hidden).view(batch, per_row, -1),
                  "hidden": out.hidden.view(batch, per_row, -1)}
        if self.capture_aux:
            result["aux"] = out.aux_hidden.view(batch, per_row, -1)
        return result

    # ---- running them ---------------------------------------------------------------------

    def decode_logits(self, graph: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of a plain decode: row b's token input_ids[b] at positions[b]."""
        size = self.settings.size_for(graph.rows)
        return self.decode.run(rows.shape[0], graph.width, size=size, tokens=input_ids[:, None],
                               first_pos=positions, rows=rows)["logits"]

    def verify_forward(self, graph: GraphShape, tokens: torch.Tensor, first_pos: torch.Tensor,
                       rows: torch.Tensor) -> tuple[torch.Tensor, ModelOutput]:
        """A verify over tokens [B, k+1] at positions first_pos[b] ..: logits [B, k+1, V] and the
        model's output over the B * (k+1) tokens (views of the graph's static outputs)."""
        size = self.settings.size_for(graph.rows)
        out = self.verify.run(rows.shape[0], (graph.chain, graph.width), size=size, tokens=tokens,
                              first_pos=first_pos, rows=rows)
        flat = out["hidden"].reshape(-1, out["hidden"].shape[-1])
        aux = out["aux"].reshape(-1, out["aux"].shape[-1]) if "aux" in out else None
        return out["logits"], ModelOutput(hidden=flat, aux_hidden=aux)

    def idle(self, graph: GraphShape) -> None:
        """DP attention: a rank with no batch replays the group's graph with padding only."""
        dev, per_row = self.target.torch_device, graph.chain + 1
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        tokens = torch.zeros(0, per_row, dtype=torch.long, device=dev)
        if graph.kind == "decode":
            self.decode_logits(graph, empty, empty, empty)
        else:
            self.verify_forward(graph, tokens, empty, empty)
        self.idle_replays += 1

    def runners(self) -> list[GraphRunner]:
        """The runners made so far."""
        return [self.__dict__[name] for name in ("decode", "verify") if name in self.__dict__]
