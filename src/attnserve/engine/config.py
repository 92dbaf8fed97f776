"""EngineConfig: every knob of the engine, with the CLI's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, GGUF file, preset name (random weights) or None (embedded SmolLM2)
    device: str = "auto"  # auto: cuda when present, else cpu; mps when asked for
    dtype: str = "auto"  # auto: bf16 on a CPU with AMX/AVX512-BF16 (else fp32); GPU: the checkpoint's (bf16 if none)
    weights_dtype: str = "auto"  # CPU projection weights: auto, dequantized, int4 (models.cpu_weights)
    cpu_threads: int | None = None  # CPU: torch threads for this process; None: torch's default (its usable CPUs)
    kv_cache_dtype: str = "auto"  # auto: the model dtype
    attention_backend: str | None = None  # None: the selection policy decides
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    no_tuned: bool = False  # True: ignore `attnserve tune` results when choosing the backend
    page_size: int | None = None  # None: 1, or what the chosen backend needs
    max_running_requests: int = 64
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from memory
    mem_fraction_static: float = 0.85  # GPU: fraction of memory for weights + KV pool
    max_context_len: int | None = None  # None: the model's (capped at 32768)
    chunked_prefill_size: int | None = 2048  # None or <= 0: off
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    disable_fused_ops: bool = False  # True: unfused torch ops on the GPU too (to compare outputs and speed)
    cuda_graph_max_bs: int | None = None  # None: min(max_running_requests, 128)
    disable_overlap_schedule: bool = False  # True: schedule step n+1 only after step n's tokens are read
    random_weights: bool = False  # with a preset/config: random weights of the real shape (benchmarks)
    seed: int = 0
    # True: greedy and seeded outputs do not depend on the batch or the prefix cache (no prefix reuse, no prompt
    # chunking, one CPU weight format, every step through the extend attention path); slower
    enable_deterministic_inference: bool = False
    tp_size: int = 1  # tensor-parallel ranks (processes, one GPU each on CUDA); the model's heads split over them
    nnodes: int = 1  # machines the tp ranks span
    node_rank: int = 0  # this machine's index; node 0 schedules and serves
    dist_init_addr: str | None = None  # HOST:PORT of node 0 where the ranks meet; None on one node: a free port

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        from attnserve.models.cpu_weights import WEIGHT_FORMATS

        if self.weights_dtype not in WEIGHT_FORMATS:
            raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights_dtype!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        from attnserve.distributed.launch import Topology

        Topology(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)  # raises on a bad combination
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {self.max_context_len}")
        from attnserve.attention.registry import resolve_name

        for name in (self.attention_backend, self.prefill_attention_backend, self.decode_attention_backend):
            if name is not None:
                resolve_name(name)  # an unknown name fails here, before any weights load
