"""The one source of truth for configuration: a frozen ServerArgs built from the CLI.

Flags are named as SGLang names them. Defaults and help live here; run.py builds
argparse from these fields, so `python run.py --help` documents every one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(REPO / "models" / "tandem-dense")
DEFAULT_DRAFTS = {"eagle": str(REPO / "models" / "tandem-dense-eagle"),
                  "eagle3": str(REPO / "models" / "tandem-dense-eagle3"),
                  "standalone": str(REPO / "models" / "tandem-dense-draft")}
SPEC_CHOICES = ["auto", "none", "eagle", "eagle3", "standalone", "ngram"]
# Chain length when --speculative-num-steps is not given, from the sweep in bench/results/history/chain_length.txt
# (embedded dense model, concurrency 1 and 16). An n-gram draft costs a lookup, not a forward, so a
# longer chain only pays for verify rows.
DEFAULT_NUM_STEPS = {"eagle": 4, "eagle3": 3, "standalone": 3, "ngram": 7}
# Batch size from which a decode step drafts nothing (0: never), from the concurrency sweeps in
# docs/performance-history.md: where speculation stops paying, plain steps are cheaper.
# standalone: on a CPU its 2-layer draft pays only for one request at a time (docs/performance-history.md,
# bench/results/history/standalone_off.txt); on a GPU, where a draft step is cheap next to the target, pass a
# larger N or 0.
# Decode steps a launch may run on the CPU when --num-scheduler-steps is not given; --max-launch-ms
# caps what one launch takes (docs/performance-history.md: multi-step decoding against llama.cpp).
CPU_SCHEDULER_STEPS = 16
DEFAULT_SPEC_OFF_BATCH_SIZE = {"eagle": 0, "eagle3": 0, "standalone": 2, "ngram": 0}


def is_moe(model_path: str) -> bool:
    """The checkpoint's config has experts (config.json's num_experts / num_local_experts)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("num_experts") or config.get("num_local_experts") or 0) > 1


def auto_adaptive(device_name: str) -> bool:
    """--speculative-adaptive auto: on on the CPU. On CUDA and NPU a speculating server captures
    graphs of its verify steps, not of plain decode steps, so a plain step there runs eagerly."""
    return device_name == "cpu"


def flag(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = flag(DEFAULT_MODEL, "Local folder of a Hugging Face checkpoint (config.json, safetensors, "
                                          "tokenizer).")
    tokenizer_path: str | None = flag(None, "Tokenizer folder (default: the model path).")
    served_model_name: str | None = flag(None, "Model name reported by /v1/models and accepted in requests "
                                               "(default: the folder name).")
    host: str = flag("127.0.0.1", "Address to listen on.")
    port: int = flag(30000, "HTTP port.")
    role: str = flag("unified", "unified: one node; prefill / decode: halves of a disaggregated deployment.",
                     ["unified", "prefill", "decode"])
    device: str = flag("auto", "Where the model runs; auto picks cuda, then npu, then cpu.",
                       ["auto", "cpu", "cuda", "npu"])
    dtype: str = flag("auto", "Weight and activation dtype; auto: bfloat16 on accelerators and on CPUs whose native "
                              "kernels multiply bf16 pairs in hardware (AVX512-BF16, AMX), else float32 (and with "
                              "quantized weights).",
                      ["auto", "float32", "bfloat16", "float16"])
    quantization: str | None = flag(None, "Weight quantization after loading (the layers' linears and the LM "
                                          "head): int8 (weight-only, one scale per output channel), w8a8_int8 (the "
                                          "same weights against each row of activations quantized to int8, int32 "
                                          "sums), or int4 (weight-only 4-bit in groups of 32 with float16 scales, "
                                          "as llama.cpp's q4_0; each group of activations quantized to int8 as "
                                          "it is read). Fast on the CPU with the native kernels; elsewhere torch "
                                          "computes the same function, slowly.",
                                    ["int8", "w8a8_int8", "int4"])
    cpu_kernels: str = flag("auto", "On the CPU, the layers' norms, SwiGLU and attention run native kernels "
                                    "(devices/native/, built at set-up): auto uses them when they build, "
                                    "native insists, torch runs pure PyTorch.", ["auto", "native", "torch"])
    max_running_requests: int = flag(64, "Most requests decoding at once on a rank.")
    max_queued_requests: int = flag(1024, "Most requests waiting on a rank; beyond it requests get 503.")
    max_total_tokens: int | None = flag(None, "KV cache size in tokens (default: from --mem-fraction-static on devices "
                                              "with memory stats, else 65536 on the CPU, where memory is taken only as "
                                              "tokens are written).")
    mem_fraction_static: float = flag(0.85, "Fraction of device memory for weights plus KV cache (devices with "
                                            "memory stats).")
    chunked_prefill_size: int = flag(512, "Most prompt tokens one request prefills in a step; longer prompts "
                                          "are chunked.")
    max_prefill_tokens: int = flag(2048, "Token budget of a step for prefill chunks (decodes come on top).")
    page_size: int = flag(1, "Tokens per KV page: the unit of KV allocation; above 1, attention gathers keys a "
                             "page at a time.")
    context_length: int | None = flag(None, "Longest prompt + output (default: the model's max_position_embeddings).")
    disable_overlap_schedule: bool = flag(False, "Finish each batch before scheduling the next (no CPU/device "
                                                 "overlap).")
    disable_radix_cache: bool = flag(False, "Keep no KV past its request: every prompt is computed from its "
                                            "first token (the radix prefix cache is on by default).")
    api_key: str | None = flag(None, "Require `Authorization: Bearer <key>` on every API request.")
    log_level: str = flag("info", "Logging level.", ["debug", "info", "warning", "error"])
    trace_file: str | None = flag(None, "Write a Chrome trace (open in Perfetto) of scheduling, launch, device "
                                        "and processing spans.")
    random_seed: int = flag(0, "Seed of the rank's sampling generator for requests without a seed.")
    speculative_algorithm: str = flag("auto", "Speculative decoding: auto = eagle with the embedded head when "
                                              "serving the embedded model (or when a draft path is given), else none. "
                                              "SGLang's upper-case names are accepted.", SPEC_CHOICES)
    speculative_draft_model_path: str | None = flag(None, "Draft model folder (EAGLE / EAGLE-3 head, or a small LM for "
                                                          "standalone); default for the embedded model: its EAGLE / "
                                                          "EAGLE-3 head or its 2-layer draft (tandem-dense-draft).")
    speculative_token_map: str | None = flag(None, "EAGLE / EAGLE-3 heads over the target's vocabulary: a file of "
                                                   "frequent token ids (torch.save of a list or 1-D tensor, as SGLang "
                                                   "reads it); drafts come only from those tokens, and each draft step "
                                                   "reads only their LM head rows. Default: the whole vocabulary.")
    speculative_draft_quantization: str = flag(
        "auto", "Quantization of the draft model (EAGLE / EAGLE-3 head, standalone draft): none, int8, w8a8_int8, "
                "int4, or auto: w8a8_int8 where the native CPU kernels take its integer sums in hardware (AMX, "
                "AVX512-VNNI, AVX2), else int8 where the target runs the native kernels, else as --quantization. "
                "The draft only proposes and the target verifies, so the output does not change; only what is "
                "accepted may.",
        ["auto", "none", "int8", "w8a8_int8", "int4"])
    speculative_num_steps: int | None = flag(None, "Draft tokens proposed per step (chain length); default: "
                                                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_NUM_STEPS.items()) + ".")
    speculative_num_draft_tokens: int | None = flag(None, "Tokens verified per step; for chains it must be steps + 1.")
    speculative_eagle_topk: int = flag(1, "Draft branching per step; only chains (1) are supported.")
    speculative_disable_by_batch_size: int | None = flag(
        None, "With at least this many requests decoding, decode as without speculation (prompt chunks join "
              "the same batches; tandem_spec_off_steps_total counts the steps). 0: always draft. Default: "
              + ", ".join(f"{k} {v}" for k, v in DEFAULT_SPEC_OFF_BATCH_SIZE.items()) + ".")
    speculative_adaptive: str = flag(
        "auto", "Speculation that pays or steps aside: measure, per batch size, the device time and accepted tokens "
                "of speculative steps and the time of plain ones as the server runs, and decode all-greedy batches "
                "plainly where speculation is expected to lose (docs/speculation-gate.md). auto: on on the CPU "
                "(where plain steps run as fast as without speculation), off elsewhere (plain steps there miss the "
                "captured graphs). --speculative-disable-by-batch-size still applies first.",
        ["auto", "on", "off"])
    dp_size: int = flag(1, "Data-parallel ranks: independent engine processes, each with its own KV cache; "
                           "the front sends each request to the least loaded one.")
    enable_dp_attention: bool = flag(False, "With --dp-size N on a MoE model: the N ranks keep their own requests "
                                            "and KV (data-parallel attention) and split the experts (expert-parallel "
                                            "MoE), stepping in lockstep over torch.distributed.")
    load_balance_method: str = flag("shortest_queue", "How the front picks a rank for a request: round_robin, the "
                                                      "one with the fewest requests (shortest_queue), the fewest "
                                                      "tokens in flight (total_tokens), or the one whose prefix "
                                                      "cache likely holds the prompt's start, balanced against load "
                                                      "(cache_aware).",
                                    ["round_robin", "shortest_queue", "total_tokens", "cache_aware"])
    nnodes: int = flag(1, "DP attention across hosts: how many hosts run the group's ranks (--dp-size in all).")
    node_rank: int = flag(0, "DP attention across hosts: this host's index (0 runs the HTTP front).")
    dist_init_addr: str | None = flag(None, "DP attention: HOST:PORT of the group's rendezvous (rank 0's host); "
                                            "default: a free local port (one host). The front of node 0 also "
                                            "takes the other nodes' ranks on PORT + 1.")
    rank_secret: str | None = flag(None, "Ranks: a shared secret every rank must prove it knows to join the front "
                                         "(HMAC challenge; never sent), or @FILE / a file path holding it. Required "
                                         "with --nnodes > 1, whose rank port is open to the network; give every host "
                                         "the same one.")
    cpu_threads: int | None = flag(None, "Torch intra-op threads of a rank's CPU stream, where the model runs "
                                         "(default: the cores per rank); the rank loop itself uses one.")
    disable_cuda_graph: bool = flag(False, "Run every step eagerly: no graph capture on any device (graphs are on by "
                                           "default on CUDA and NPU, off on the CPU).")
    cuda_graph_max_bs: int | None = flag(None, "Largest batch captured as a graph; larger batches run eagerly "
                                               "(default: --max-running-requests).")
    cuda_graph_bs: tuple[int, ...] = flag((), "Batch sizes captured as graphs (default: 1 2 4 8 12 16 24 32 40 ... "
                                              "up to --cuda-graph-max-bs); a batch is padded to the next one.")
    enable_cpu_graph: bool = flag(False, "On the CPU, run decode, verify and draft steps through the graph runner "
                                         "too (static buffers replayed eagerly, padded to the capture sizes, whole "
                                         "chains): the CI path of CUDA/NPU graphs, not a speed-up.")
    num_scheduler_steps: int | None = flag(None, "When no prompt is waiting, run up to N decode steps in one launch "
                                                 "(vLLM's name): plain decoding feeds each row its own last token, "
                                                 "speculative decoding drafts and verifies N times from what each "
                                                 "round accepted. The rank loop, the front and the client then work "
                                                 "once per launch. Default: 16 on the CPU (where that work shares "
                                                 "the cores with the forward), 1 on accelerators, with DP "
                                                 "attention and with --enable-cpu-graph.")
    max_launch_ms: float = flag(20.0, "A launch of several steps runs only as many as fit in this many milliseconds "
                                      "(by the measured time of a step of its size): a new prompt, an abort or a "
                                      "stream waits at most that long for it. 0: no cap.")
    stream_interval: int = flag(1, "Stream output to the client once at least N new tokens are ready (and at the end).")
    max_request_bytes: int = flag(16 * 1024 * 1024, "Largest HTTP request body accepted; larger ones get 413.")
    max_rank_restarts: int = flag(3, "Rank processes that die are restarted; after this many deaths within 10 "
                                     "minutes the server gives up and exits non-zero (0: never restart).")
    disaggregation_bootstrap_port: int = flag(8998, "--role prefill: the TCP port decode nodes connect to.")
    prefill_addr: tuple[str, ...] = flag((), "--role decode: HOST:PORT of a prefill node's bootstrap port (repeat "
                                             "the flag for several; prompts go to the one with the fewest tokens in "
                                             "flight).")
    disaggregation_transfer_backend: str = flag("tcp", "How KV moves between prefill and decode nodes, a transport "
                                                       "registered in server/pd/transport.py: tcp (asyncio sockets, "
                                                       "the built-in one).")
    pd_secret: str | None = flag(None, "Prefill/decode: a shared secret both nodes must prove they know (HMAC "
                                       "challenge; never sent), or @FILE / a file path holding it.")
    disaggregation_timeout: float = flag(60.0, "Prefill/decode: seconds a request may wait for its prefill node "
                                               "(connecting, prefilling, transferring) before it fails.")
    shutdown_timeout: float = flag(30.0, "On SIGTERM / SIGINT: seconds in-flight requests may still run before "
                                         "they are ended with an error.")

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    @property
    def spec_algorithm(self) -> str:
        """The resolved algorithm: none, eagle, eagle3, standalone or ngram."""
        algo = self.speculative_algorithm.lower()
        if algo != "auto":
            return algo
        if self.speculative_draft_model_path:
            return "eagle"
        return "eagle" if Path(self.model_path).resolve() == Path(DEFAULT_MODEL) else "none"

    @property
    def num_steps(self) -> int:
        """The resolved chain length (0 without speculation)."""
        if self.spec_algorithm == "none":
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:      # a chain verifies steps + 1 tokens
            return self.speculative_num_draft_tokens - 1
        return DEFAULT_NUM_STEPS[self.spec_algorithm]

    @property
    def spec_off_batch_size(self) -> int:
        if self.spec_algorithm == "none":
            return 0
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return DEFAULT_SPEC_OFF_BATCH_SIZE[self.spec_algorithm]

    def adaptive_speculation(self, device_name: str) -> bool:
        """--speculative-adaptive resolved on this device (False without speculation)."""
        if self.spec_algorithm == "none" or self.speculative_adaptive == "off":
            return False
        return self.speculative_adaptive == "on" or auto_adaptive(device_name)

    @property
    def draft_model_path(self) -> str | None:
        if self.spec_algorithm in ("none", "ngram"):
            return None
        if self.speculative_draft_model_path:
            return self.speculative_draft_model_path
        if Path(self.model_path).resolve() == Path(DEFAULT_MODEL) and self.spec_algorithm in DEFAULT_DRAFTS:
            return DEFAULT_DRAFTS[self.spec_algorithm]
        return None

    @property
    def token_map_given(self) -> bool:
        return (self.speculative_token_map or "none").lower() != "none"

    @property
    def token_map_path(self) -> str | None:
        """The token map the EAGLE head drafts from (None: the whole vocabulary)."""
        has_head = self.spec_algorithm in ("eagle", "eagle3")
        return self.speculative_token_map if has_head and self.token_map_given else None

    def validate(self) -> None:
        """Refuse contradictory flags with a message naming them."""
        self.validate_speculation()
        if (self.speculative_disable_by_batch_size or 0) < 0:
            raise ValueError("--speculative-disable-by-batch-size must be >= 0")
        if self.max_request_bytes < 1024 or self.max_rank_restarts < 0 or not self.shutdown_timeout >= 0:
            raise ValueError("--max-request-bytes must be at least 1024, --max-rank-restarts and "
                             "--shutdown-timeout at least 0")
        max_bs = self.cuda_graph_max_bs if self.cuda_graph_max_bs is not None else 1
        if min((max_bs, *self.cuda_graph_bs)) < 1:
            raise ValueError("--cuda-graph-max-bs and --cuda-graph-bs must be positive")
        self.validate_disaggregation()
        self.validate_dp_attention()
        self.validate_multi_step()
        if min(self.page_size, self.max_running_requests, self.chunked_prefill_size, self.stream_interval,
               self.max_prefill_tokens, self.dp_size) < 1:
            raise ValueError("--page-size, --max-running-requests, --chunked-prefill-size, --max-prefill-tokens, "
                             "--stream-interval and --dp-size must be positive")

    def validate_multi_step(self) -> None:
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise ValueError("--num-scheduler-steps must be at least 1")
        if not self.max_launch_ms >= 0:
            raise ValueError("--max-launch-ms must be at least 0")
        if (self.num_scheduler_steps or 1) > 1 and self.enable_dp_attention:
            raise ValueError("--num-scheduler-steps does not combine with --enable-dp-attention (the group steps "
                             "one token at a time)")

    def validate_dp_attention(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--node-rank must be in [0, --nnodes)")
        if self.nnodes > 1 and (not self.enable_dp_attention or not self.dist_init_addr):
            raise ValueError("--nnodes > 1 needs --enable-dp-attention and --dist-init-addr HOST:PORT")
        if self.nnodes > 1 and not self.rank_secret:
            raise ValueError("--nnodes > 1 needs --rank-secret (the same on every host): node 0's rank port is "
                             "open to the network")
        if self.enable_dp_attention and self.dp_size % self.nnodes:
            raise ValueError(f"--dp-size {self.dp_size} must be a multiple of --nnodes {self.nnodes}")
        if self.enable_dp_attention and self.dp_size < 2:
            raise ValueError("--enable-dp-attention needs --dp-size 2 or more")
        if self.enable_dp_attention and not is_moe(self.model_path):
            raise ValueError(f"--enable-dp-attention is for MoE models (their experts are split over the ranks); "
                             f"{self.model_path} is dense: use --dp-size alone for independent ranks")

    def validate_disaggregation(self) -> None:
        if self.role == "decode" and not self.prefill_addr:
            raise ValueError("--role decode needs at least one --prefill-addr HOST:PORT")
        if self.role != "decode" and self.prefill_addr:
            raise ValueError("--prefill-addr is for --role decode")
        for addr in self.prefill_addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--prefill-addr {addr!r}: expected HOST:PORT")
        if not self.disaggregation_timeout > 0:
            raise ValueError("--disaggregation-timeout must be positive")

    def validate_speculation(self) -> None:
        if self.speculative_eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk}: only chain drafts (1) "
                             f"are supported")
        if self.spec_algorithm != "none" and self.num_steps < 1:
            raise ValueError("--speculative-num-steps must be at least 1 (--speculative-num-draft-tokens at least 2)")
        if self.num_steps and self.speculative_num_draft_tokens not in (None, self.num_steps + 1):
            raise ValueError(f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 "
                             f"({self.num_steps + 1}) for chain drafts")
        if self.spec_algorithm in ("eagle", "eagle3", "standalone") and not self.draft_model_path:
            raise ValueError(f"--speculative-algorithm {self.spec_algorithm} needs --speculative-draft-model-path")
        if self.token_map_given and self.spec_algorithm not in ("eagle", "eagle3"):
            raise ValueError(f"--speculative-token-map applies to EAGLE / EAGLE-3 heads, not to "
                             f"--speculative-algorithm {self.spec_algorithm}")

    def scheduler_steps(self, device_name: str) -> int:
        """--num-scheduler-steps, or its default on this device."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        cpu_eager = device_name == "cpu" and not self.enable_cpu_graph     # the graph path stands in for CUDA's
        return CPU_SCHEDULER_STEPS if cpu_eager and not self.enable_dp_attention else 1

    @property
    def enable_overlap(self) -> bool:
        return not self.disable_overlap_schedule

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run.py", description="Tandem: a compact LLM inference server.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(ServerArgs):
        name = "--" + f.name.replace("_", "-")
        help_text, choices = f.metadata["help"], f.metadata["choices"]
        if f.type in ("bool", bool):
            parser.add_argument(name, action="store_true", help=help_text)
            continue
        if str(f.type) == "tuple[int, ...]":               # SGLang's --cuda-graph-bs 1 2 4 8
            parser.add_argument(name, nargs="+", type=int, default=None, help=help_text)
            continue
        if str(f.type).startswith("tuple"):
            parser.add_argument(name, action="append", default=None, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        if f.name == "speculative_algorithm":
            kind = str.lower          # SGLang spells them EAGLE, EAGLE3, NGRAM, STANDALONE
        parser.add_argument(name, type=kind, default=f.default, choices=choices, help=help_text)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    for f in dataclasses.fields(ServerArgs):
        if str(f.type).startswith("tuple"):                # repeated flags: every value given, in order
            values[f.name] = tuple(values[f.name] or ())
    args = ServerArgs(**values)
    try:
        args.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return args
