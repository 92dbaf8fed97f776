"""EngineConfig: every knob of the engine, each declared once with its command-line flag and help.

A field whose metadata names `flags` is a command-line knob: `commands/engine_args.py` builds the
parser from these fields (the flag names, defaults, types and help) and the config from the parsed
flags, so `serve`, `generate` and `tune` (and `bench serve --launch`, which starts `serve`) read the
same declaration. The flag names are SGLang's where it has them. A field without `flags` (`seed`) is
set from Python only. `__post_init__` checks every value once, before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.choice.registry import resolve_name
from attnserve.distributed.launch import Topology
from attnserve.engine.schedule_policy import SCHEDULE_POLICIES, checked_step_budget
from attnserve.models.cpu_weights import WEIGHT_FORMATS


def knob(default, *flags: str, help: str, metavar: str | None = None, choices=None):  # noqa: A002 - argparse's word
    """A dataclass field with its command-line flags (the first is the canonical name) and help.

    A bool knob is a switch (`store_true`); any other takes one value of the field's type. `help` may
    name `{backends}`, filled with the implemented attention backends when the parser is built."""
    cli = {"flags": flags, "help": help}
    if metavar is not None:
        cli["metavar"] = metavar
    if choices is not None:
        cli["choices"] = tuple(choices)
    return field(default=default, metadata=cli)


@dataclass
class EngineConfig:
    model: str | None = knob(
        None, "--model", "--model-path",
        help="HF model directory, .gguf file, or (with --random-weights) a preset; default: embedded SmolLM2")
    tp_size: int = knob(
        1, "--tp-size", "--tensor-parallel-size",
        help="tensor-parallel size: the model's heads and channels split over this many processes (one "
        "GPU each on CUDA: NCCL; gloo on the CPU); default 1")
    nnodes: int = knob(1, "--nnodes", help="machines the --tp-size ranks span (default 1)")
    node_rank: int = knob(
        0, "--node-rank",
        help="this machine's index among --nnodes; node 0 schedules and serves, the others run ranks only")
    dist_init_addr: str | None = knob(
        None, "--dist-init-addr", metavar="HOST:PORT",
        help="where the ranks meet: node 0's address and a free port, the same on every node "
        "(default on one node: a free local port)")
    random_weights: bool = knob(False, "--random-weights", help="random weights of the model's shape (to measure speed)")
    attention_backend: str | None = knob(
        None, "--attention-backend", metavar="NAME",
        help="attention backend for prefill and decode (default: chosen for this machine and model; "
        "see `attnserve select`); one of: {backends}")
    prefill_attention_backend: str | None = knob(
        None, "--prefill-attention-backend", metavar="NAME", help="attention backend for prefill only (same names)")
    decode_attention_backend: str | None = knob(
        None, "--decode-attention-backend", metavar="NAME", help="attention backend for decode only (same names)")
    no_tuned: bool = knob(
        False, "--no-tuned",
        help="ignore `attnserve tune` results when choosing the backend (by default a current result "
        "for this machine and model shape puts its measured winner first)")
    device: str = knob("auto", "--device", help="auto (cuda when present, else cpu), cpu, cuda[:N] or mps")
    dtype: str = knob(
        "auto", "--dtype",
        help="model dtype: auto (CPU: bf16 where it has AMX or AVX512-BF16, else fp32; GPU: the "
        "checkpoint's, bf16 if unstated), bf16, fp16, fp32")
    weights_dtype: str = knob(
        "auto", "--weights-dtype", choices=WEIGHT_FORMATS,
        help="CPU projection weights: auto (a bf16 model from a GGUF with Q4_0/Q4_1 weights keeps them "
        "4-bit for the int4 kernel at 1-2 rows and runs prepacked bf16 above; else dequantized), "
        "dequantized (dense, in --dtype), int4 (4-bit only: least memory, slow prefill)")
    cpu_threads: int | None = knob(
        None, "--cpu-threads",
        help="CPU: threads for the matmuls (default: torch's, one per usable core). On a machine shared "
        "with other busy processes, fewer threads than cores can be faster: every parallel op waits "
        "for its slowest thread")
    kv_cache_dtype: str = knob(
        "auto", "--kv-cache-dtype",
        help="KV cache dtype: auto (the model dtype), bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
    page_size: int | None = knob(
        None, "--page-size", help="tokens per KV page (default: 1, or what the chosen backend needs)")
    max_running_requests: int = knob(
        64, "--max-running-requests", help="most requests decoding at once (default: 64)")
    max_total_tokens: int | None = knob(None, "--max-total-tokens", help="KV pool size in tokens")
    mem_fraction_static: float = knob(
        0.85, "--mem-fraction-static", help="GPU: fraction of device memory for weights plus the KV pool (default: 0.85)")
    max_prefill_tokens: int = knob(
        16384, "--max-prefill-tokens",
        help="prefill tokens per step when chunking is off (default: 16384; one prompt may exceed it)")
    max_context_len: int | None = knob(
        None, "--context-length",
        help="longest prompt + output (default: the model's, capped at 32768)")
    chunked_prefill_size: int | None = knob(
        2048, "--chunked-prefill-size", help="prefill tokens per chunk (default: 2048); <= 0 turns chunking off")
    max_num_batched_tokens: str | int | None = knob(
        None, "--max-num-batched-tokens", metavar="N|auto[:S]",
        help="prompt tokens a step that decodes may add beside the running streams (Sarathi-Serve's "
        "stall-free batching; a step with nothing decoding always takes --chunked-prefill-size). N: at most "
        "N tokens in the step, its decodes included (one each): stalls stay short, but every mixed step "
        "pays its fixed cost, so a small N costs throughput on a GPU. auto: beside D decodes, "
        "min(chunk, max(256, S / D)) prompt tokens (S = 65536 unless auto:S): many streams get short "
        "stalls, few streams big chunks. <= 0: off (a whole chunk joins the decodes: the best throughput, "
        "and every stream stalls for the chunk). Default on a GPU: 1024 where piecewise CUDA graphs run "
        "(on an H100, 0.96x the best throughput at an ITL p99 of 30 ms), else 2048 (on an H200, 0.99x the "
        "best throughput at an ITL p99 of 52 ms); 512 on a CPU (there every prompt token is a stall), or "
        "2 x --max-running-requests when larger")
    schedule_policy: str = knob(
        "fcfs", "--schedule-policy", choices=SCHEDULE_POLICIES,
        help="order in which waiting prompts are admitted: fcfs (arrival order; default: no prompt waits "
        "behind later ones) or lpm (longest radix-cache prefix match first)")
    disable_radix_cache: bool = knob(False, "--disable-radix-cache", help="no prefix cache")
    disable_cuda_graph: bool = knob(False, "--disable-cuda-graph", help="decode runs eagerly")
    disable_overlap_schedule: bool = knob(
        False, "--disable-overlap-schedule",
        help="schedule each step only after the previous step's tokens reach the host "
        "(default: the host schedules and plans step n+1 while the device runs step n)")
    enable_deterministic_inference: bool = knob(
        False, "--enable-deterministic-inference",
        help="greedy and seeded logits that do not depend on the batch or the prefix cache (bitwise, on the "
        "CPU): no prefix-cache reuse, no prompt chunking, one CPU weight format in calls of a fixed row count, "
        "every step through the extend attention path, preempted requests recomputed as they first ran; "
        "flex_attention and speculative decoding are refused (slower; default: off)")
    cuda_graph_max_bs: int | None = knob(
        None, "--cuda-graph-max-bs",
        help="largest decode batch captured in a graph (default: min(--max-running-requests, 128))")
    disable_piecewise_cuda_graph: bool = knob(
        False, "--disable-piecewise-cuda-graph",
        help="steps that carry prompt tokens run eagerly (default: on a GPU with CUDA graphs on, they replay "
        "graphs of everything but attention, which runs eagerly between them, up to "
        "--piecewise-cuda-graph-max-tokens; Llama-family models, not MLA, not under deterministic inference)")
    piecewise_cuda_graph_max_tokens: int | None = knob(
        None, "--piecewise-cuda-graph-max-tokens",
        help="largest step, in tokens, captured in piecewise graphs (default: the step budget when it is a "
        "number, else 2048); larger steps run eagerly")
    disable_fused_ops: bool = knob(
        False, "--disable-fused-ops",
        help="run the unfused torch ops (RMSNorm, SiLU x up, RoPE, K/V store) on the GPU too")
    enable_pdl: bool = knob(
        False, "--enable-pdl",
        help="launch the fused Triton ops with programmatic dependent launch on SM90+ GPUs: each kernel starts "
        "while the one before it finishes and waits for it before touching memory (default: off)")
    speculative_algorithm: str | None = knob(
        None, "--speculative-algorithm", metavar="NAME",
        help="speculative decoding: ngram (drafts by prompt lookup over each request's prompt and output, "
        "verified by the model in one step; case-insensitive); default: off")
    speculative_num_draft_tokens: int = knob(
        4, "--speculative-num-draft-tokens",
        help="draft tokens verified per request per step, the last token excluded (default: 4)")
    speculative_num_steps: int | None = knob(
        None, "--speculative-num-steps", help="deepest draft in a tree (default: --speculative-num-draft-tokens)")
    speculative_eagle_topk: int = knob(
        1, "--speculative-eagle-topk",
        help="draft tree branching: continuations merged into one tree (default: 1, a chain)")
    speculative_ngram_min_match_window_size: int = knob(
        2, "--speculative-ngram-min-match-window-size",
        help="ngram: shortest suffix of a request's tokens matched against its earlier tokens (default: 2)")
    speculative_ngram_max_match_window_size: int = knob(
        12, "--speculative-ngram-max-match-window-size",
        help="ngram: longest suffix matched, tried first (default: 12)")
    speculative_attention_mode: str = knob(
        "prefill", "--speculative-attention-mode", choices=("prefill", "decode"),
        help="which backend runs the verify step when prefill and decode backends differ (default: prefill)")
    seed: int = 0  # random weights' seed (with random_weights)

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.weights_dtype not in WEIGHT_FORMATS:
            raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights_dtype!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        # unset stays None: the device's default is resolved at start-up (schedule_policy.resolve_step_budget)
        self.max_num_batched_tokens = checked_step_budget(self.max_num_batched_tokens, self.max_running_requests)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {self.schedule_policy!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        Topology(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)  # raises on a bad combination
        if self.enable_deterministic_inference:  # what the mode turns off, so the log and /server_info say so
            self.chunked_prefill_size = None
            self.disable_radix_cache = True
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {self.max_context_len}")
        self._check_speculative()
        for name in (self.attention_backend, self.prefill_attention_backend, self.decode_attention_backend):
            if name is not None:
                resolve_name(name)  # an unknown name fails here, before any weights load

    @property
    def speculative_topk(self) -> int:
        """The draft tree's branching as the backend selection sees it (0: no speculative decoding)."""
        return self.speculative_eagle_topk if self.speculative_algorithm else 0

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.lower()
            if algo in ("", "none"):
                algo = None
            elif algo != "ngram":
                raise ValueError(f"speculative_algorithm must be ngram (or None), got {self.speculative_algorithm!r}")
            self.speculative_algorithm = algo
        for name in ("speculative_num_draft_tokens", "speculative_eagle_topk",
                     "speculative_ngram_min_match_window_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ValueError(
                f"speculative_ngram_max_match_window_size {self.speculative_ngram_max_match_window_size} is below "
                f"the min {self.speculative_ngram_min_match_window_size}")
        if self.speculative_attention_mode not in ("prefill", "decode"):
            raise ValueError(f"speculative_attention_mode must be prefill or decode, got "
                             f"{self.speculative_attention_mode!r}")
        if self.speculative_algorithm and self.enable_deterministic_inference:
            # whether a step verifies depends on the other requests (prompts waiting, pages free), and a verify
            # step computes a request's tokens in other shapes and draws its noise otherwise than a decode
            raise ValueError("speculative decoding cannot run with enable_deterministic_inference: whether a "
                             "request's tokens are verified or decoded depends on the other requests, so its "
                             "output would depend on the batch; turn one of them off")
