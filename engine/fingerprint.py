"""Fingerprints: what the two ends of a link must serve alike, each computed from that side's own
flags and model folders and compared by the handshake (engine/handshake.py).

Cheap by design, since every rank computes one as it starts: a model is known by its architecture
and a hash of its config.json, never by its weights (hashing gigabytes would slow every start); a
token map (a list of ids) is hashed whole.

| link           | what it covers                                                        | form                |
|----------------|-----------------------------------------------------------------------|---------------------|
| front/rank     | rank_fingerprint: the model, the flags of what it computes and its KV | `name=value` fields |
| prefill/decode | server/pd/fingerprint.py: the same, as the ranks resolved it          | a 16-hex digest     |

A fingerprint of `name=value` fields lets a refusal name what differs (`differing_fields`).
"""
from __future__ import annotations

import hashlib
import json
import os

FINGERPRINT_HEX_CHARS = 16
MODEL_HASH_CHARS = 12
# keys that record how a config was written, not what the model computes: a re-saved copy of the
# same model must still pair
UNHASHED_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")
NO_SPECULATION = ("", "none")


def rank_fingerprint(args) -> str:
    """What a rank and its front must agree on, from one side's ServerArgs, as `name=value` fields.

    The flags as given: the front never loads torch, so it cannot resolve --dtype auto or the
    draft's auto quantization; it compares what each rank resolved when its RankReady arrives
    (server/rank_client.py: resolved_mismatch). Out: what does not change what a rank computes or
    what its KV means (the scheduler's flags, --cpu-kernels: native and torch kernels compute the
    same function) and what differs by design between hosts (--node-rank, paths of the same model).
    """
    algorithm = args.spec_algorithm
    speculating = algorithm not in NO_SPECULATION
    fields = {
        "model": model_tag(args.model_path),
        "dtype": args.dtype,
        "quantization": args.quantization or "none",
        "page_size": args.page_size,
        "context_length": args.context_length or "model",
        "speculative": f"{algorithm}x{args.num_steps}" if speculating else "none",
        "draft": model_tag(args.draft_model_path) if speculating and args.draft_model_path else "none",
        "draft_quantization": args.speculative_draft_quantization if speculating and args.draft_model_path
        else "none",
        "token_map": file_sha256(args.token_map_path)[:MODEL_HASH_CHARS] if args.token_map_path else "none",
        "dp_size": args.dp_size,
        "dp_attention": "on" if args.enable_dp_attention else "off",
        "nnodes": args.nnodes,
    }
    return " ".join(f"{name}={_plain(value)}" for name, value in fields.items())


def differing_fields(first: str, second: str) -> list[tuple[str, str, str]]:
    """(name, first's value, second's value) of each field two `name=value` fingerprints disagree on
    (a field one of them lacks shows as "-"); [] when either is not of that form (a digest)."""
    mine, theirs = _fields(first), _fields(second)
    if mine is None or theirs is None:
        return []
    names = list(mine) + [name for name in theirs if name not in mine]
    return [(name, mine.get(name, "-"), theirs.get(name, "-")) for name in names
            if mine.get(name) != theirs.get(name)]


def _fields(fingerprint: str) -> dict[str, str] | None:
    pairs = [part.partition("=") for part in fingerprint.split()]
    if not pairs or any(not sep for _, sep, _ in pairs):
        return None
    return {name: value for name, _, value in pairs}


def _plain(value) -> str:
    """A field's value with nothing that would split the fields."""
    return str(value).replace(" ", "_").replace("=", ":")


def model_tag(model_path: str) -> str:
    """A model folder as one short word: its architecture and the start of its config's hash."""
    identity = model_identity(model_path)
    return f"{identity['architecture']}:{identity['config_sha256'][:MODEL_HASH_CHARS]}"


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
            "config_sha256": hashlib.sha256(canonical_json(hashed)).hexdigest()}


def file_sha256(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        raise ValueError(f"model fingerprint: cannot read {path}: {exc.strerror}") from exc


def digest(fields: dict) -> str:
    """A short sha256 hex digest of fields (plain JSON values)."""
    return hashlib.sha256(canonical_json(fields)).hexdigest()[:FINGERPRINT_HEX_CHARS]


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
