"""What a prefill node and a decode node must serve alike, as one short digest for the handshake.

KV written by one node is read by the other's attention, and the first token's draft state feeds
the other's speculative worker, so everything that decides what those bytes mean must match: the
target model (its config), the dtype it runs in, its weight quantization (the KV it writes depends
on it), the KV cache's dtype, the page size, and the speculation: algorithm, chain length, draft
model, the draft's own weight quantization (it writes the draft KV) and the EAGLE token map (the
draft state indexes it). Both nodes compute the fingerprint from their own flags and folders; the
handshake compares the two.

Pass resolved values: the dtypes actually used ("bfloat16", not "auto"), the speculative algorithm
actually run ("eagle" or "none", not "auto") and the draft quantization the ranks chose (its "auto"
depends on the CPU). What does not change the bytes' meaning stays out (--cpu-kernels: native and
torch kernels compute the same function; the context length; the scheduler's flags).
"""
from __future__ import annotations

import logging

from engine.fingerprint import NO_SPECULATION, digest, file_sha256, model_identity

log = logging.getLogger("tandem.pd")


def model_fingerprint(*identity, **options) -> str:
    """A short sha256 hex digest of the canonical JSON of what both nodes must share (the arguments
    of fingerprint_fields)."""
    return digest(fingerprint_fields(*identity, **options))


def node_fingerprint(args, readies: list) -> str:
    """The fingerprint of a node whose ranks are up (`readies`: their RankReady, which names the dtype
    they resolved), logged with what it covers."""
    ready = readies[0]
    identity = (args.model_path, ready.dtype, args.page_size, args.spec_algorithm, args.num_steps,
                args.draft_model_path, args.quantization)
    options = {"kv_dtype": ready.kv_dtype or None, "draft_quantization": ready.draft_weights,
               "token_map": args.token_map_path}
    log.info("prefill/decode: %s", describe(*identity, **options))
    return model_fingerprint(*identity, **options)


def describe(*identity, **options) -> str:
    """One line for the log, e.g. "LlamaForCausalLM bfloat16 int8, page 1, eagle x4 with LlamaForCausalLMEagle"."""
    fields = fingerprint_fields(*identity, **options)
    weights = "" if fields["quantization"] == "none" else f" {fields['quantization']}"
    kv = "" if fields["kv_dtype"] == fields["dtype"] else f", KV {fields['kv_dtype']}"
    text = f"{fields['target']['architecture']} {fields['dtype']}{weights}{kv}, page {fields['page_size']}"
    spec = fields["speculative"]
    if spec["algorithm"] != "none":
        text += f", {spec['algorithm']} x{spec['num_steps']}"
    if fields["draft"]:
        text += f" with {fields['draft']['architecture']}"
    return f"{text} (fingerprint {digest(fields)})"


def fingerprint_fields(model_path: str, dtype_name: str, page_size: int, spec_algorithm: str | None,
                       num_steps: int, draft_model_path: str | None, quantization: str | None = None, *,
                       kv_dtype: str | None = None, draft_quantization: str | None = None,
                       token_map: str | None = None) -> dict:
    """The fields the fingerprint digests (a dict of plain JSON values). kv_dtype None: the KV cache is
    in the model's dtype; token_map: the EAGLE head's token map file, or None for the whole vocabulary."""
    algorithm = (spec_algorithm or "none").lower()
    speculating = algorithm not in NO_SPECULATION
    dtype = dtype_name.removeprefix("torch.")
    return {
        "target": model_identity(model_path),
        "dtype": dtype,
        "kv_dtype": (kv_dtype or dtype).removeprefix("torch."),
        "quantization": quantization or "none",
        "page_size": page_size,
        # without speculation the chain length, the draft and its token map are meaningless: they must
        # not keep two nodes apart
        "speculative": {"algorithm": algorithm if speculating else "none",
                        "num_steps": num_steps if speculating else 0,
                        "token_map": file_sha256(token_map) if speculating and token_map else None},
        "draft": draft_identity(draft_model_path, draft_quantization) if speculating and draft_model_path else None,
    }


def draft_identity(draft_model_path: str, draft_quantization: str | None) -> dict:
    return {**model_identity(draft_model_path), "quantization": draft_quantization or "none"}
