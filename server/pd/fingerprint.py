"""What a prefill node and a decode node must serve alike, as one short digest for the handshake.

KV written by one node is read by the other's attention, and the first token's draft state feeds
the other's speculative worker: the target model, its weight quantization (the KV it writes depends
on it), the KV dtype, the page size and the speculation (algorithm, chain length, draft model) must
all match. Both nodes compute the fingerprint from
their own flags and folders; the handshake compares the two.

Pass resolved values: the dtype actually used ("bfloat16", not "auto") and the speculative
algorithm actually run ("eagle" or "none", not "auto").
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

FINGERPRINT_HEX_CHARS = 16
# keys that record how a config was written, not what the model computes: a re-saved copy of the
# same model must still pair
UNHASHED_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")
NO_SPECULATION = ("", "none")
log = logging.getLogger("tandem.pd")


def model_fingerprint(model_path: str, dtype_name: str, page_size: int, spec_algorithm: str | None,
                      num_steps: int, draft_model_path: str | None, quantization: str | None = None) -> str:
    """A short sha256 hex digest of the canonical JSON of what both nodes must share."""
    return _digest(fingerprint_fields(model_path, dtype_name, page_size, spec_algorithm, num_steps, draft_model_path,
                                      quantization))


def node_fingerprint(args, readies: list) -> str:
    """The fingerprint of a node whose ranks are up (`readies`: their RankReady, which names the dtype
    they resolved), logged with what it covers."""
    identity = (args.model_path, readies[0].dtype, args.page_size, args.spec_algorithm, args.num_steps,
                args.draft_model_path, args.quantization)
    log.info("prefill/decode: %s", describe(*identity))
    return model_fingerprint(*identity)


def describe(model_path: str, dtype_name: str, page_size: int, spec_algorithm: str | None,
             num_steps: int, draft_model_path: str | None, quantization: str | None = None) -> str:
    """One line for the log, e.g. "LlamaForCausalLM bfloat16 int8, page 1, eagle x4 with LlamaForCausalLMEagle"."""
    fields = fingerprint_fields(model_path, dtype_name, page_size, spec_algorithm, num_steps, draft_model_path,
                                quantization)
    weights = "" if fields["quantization"] == "none" else f" {fields['quantization']}"
    text = f"{fields['target']['architecture']} {fields['dtype']}{weights}, page {fields['page_size']}"
    spec = fields["speculative"]
    if spec["algorithm"] != "none":
        text += f", {spec['algorithm']} x{spec['num_steps']}"
    if fields["draft"]:
        text += f" with {fields['draft']['architecture']}"
    return f"{text} (fingerprint {_digest(fields)})"


def fingerprint_fields(model_path: str, dtype_name: str, page_size: int, spec_algorithm: str | None,
                       num_steps: int, draft_model_path: str | None, quantization: str | None = None) -> dict:
    """The fields the fingerprint digests (a dict of plain JSON values)."""
    algorithm = (spec_algorithm or "none").lower()
    speculating = algorithm not in NO_SPECULATION
    return {
        "target": model_identity(model_path),
        "dtype": dtype_name.removeprefix("torch."),
        "quantization": quantization or "none",
        "page_size": page_size,
        # without speculation the chain length is meaningless: it must not keep two nodes apart
        "speculative": {"algorithm": algorithm if speculating else "none",
                        "num_steps": num_steps if speculating else 0},
        "draft": model_identity(draft_model_path) if speculating and draft_model_path else None,
    }


def model_identity(model_path: str) -> dict:
    """A model folder's architecture and a hash of its config.json (canonical, so formatting does not count)."""
    config_path = os.path.join(model_path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model fingerprint: cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model fingerprint: {config_path} is not a JSON object")
    hashed = {key: value for key, value in config.items() if key not in UNHASHED_CONFIG_KEYS}
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    return {"architecture": "+".join(map(str, architectures)),
            "config_sha256": hashlib.sha256(_canonical_json(hashed)).hexdigest()}


def _digest(fields: dict) -> str:
    return hashlib.sha256(_canonical_json(fields)).hexdigest()[:FINGERPRINT_HEX_CHARS]


def _canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
