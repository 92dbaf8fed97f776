"""The engine's command-line flags, shared by `generate` and `serve` (SGLang's names where it has them)."""

from __future__ import annotations

import argparse


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from attnserve.attention.registry import REGISTRY

    backends = ", ".join(sorted(name for name, spec in REGISTRY.items() if spec.implemented))
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model directory, .gguf file, or (with --random-weights) a preset; default: embedded SmolLM2")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="tensor-parallel size: the model's heads and channels split over this many processes (one "
                   "GPU each on CUDA: NCCL; gloo on the CPU); default 1")
    p.add_argument("--nnodes", type=int, default=1, help="machines the --tp-size ranks span (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index among --nnodes; node 0 schedules and serves, the others run ranks only")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where the ranks meet: node 0's address and a free port, the same on every node "
                   "(default on one node: a free local port)")
    p.add_argument("--random-weights", action="store_true", help="random weights of the model's shape (benchmarks)")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help=f"attention backend for prefill and decode (default: chosen for this machine and model; "
                   f"see `attnserve select`); one of: {backends}")
    p.add_argument("--prefill-attention-backend", default=None, metavar="NAME",
                   help="attention backend for prefill only (same names)")
    p.add_argument("--decode-attention-backend", default=None, metavar="NAME",
                   help="attention backend for decode only (same names)")
    p.add_argument("--no-tuned", action="store_true",
                   help="ignore `attnserve tune` results when choosing the backend (by default a current result "
                   "for this machine and model shape puts its measured winner first)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda[:N] or mps")
    p.add_argument("--dtype", default="auto",
                   help="model dtype: auto (CPU: bf16 where it has AMX or AVX512-BF16, else fp32; GPU: the "
                   "checkpoint's, bf16 if unstated), bf16, fp16, fp32")
    p.add_argument("--weights-dtype", default="auto", choices=["auto", "dequantized", "int4"],
                   help="CPU projection weights: auto (a bf16 model from a GGUF with Q4_0/Q4_1 weights keeps them "
                   "4-bit for the int4 kernel at 1-2 rows and runs prepacked bf16 above; else dequantized), "
                   "dequantized (dense, in --dtype), int4 (4-bit only: least memory, slow prefill)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: threads for the matmuls (default: torch's, one per usable core). On a machine shared "
                   "with other busy processes, fewer threads than cores can be faster: every parallel op waits "
                   "for its slowest thread")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype: auto (the model dtype), bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: 1, or what the chosen backend needs)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="most requests decoding at once (default: 64)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="GPU: fraction of device memory for weights plus the KV pool (default: 0.85)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="prefill tokens per step when chunking is off (default: 16384; one prompt may exceed it)")
    p.add_argument("--context-length", type=int, default=None, help="longest prompt + output (default: the model's)")
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="prefill tokens per chunk (default: 2048); <= 0 turns chunking off")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode runs eagerly")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="schedule each step only after the previous step's tokens reach the host "
                   "(default: the host schedules and plans step n+1 while the device runs step n)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="greedy and seeded outputs that do not depend on the batch or the prefix cache: no "
                   "prefix-cache reuse, no prompt chunking, one CPU weight format, and every step through the "
                   "extend attention path (slower; default: off)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="largest decode batch captured in a graph")
    p.add_argument("--disable-fused-ops", action="store_true",
                   help="run the unfused torch ops (RMSNorm, SiLU x up, RoPE, K/V store) on the GPU too")


def engine_settings(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from the parsed flags."""
    return dict(
        model=args.model, attention_backend=args.attention_backend,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend, device=args.device, dtype=args.dtype,
        weights_dtype=args.weights_dtype, cpu_threads=args.cpu_threads,
        kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
        max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, max_context_len=args.context_length,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        disable_radix_cache=args.disable_radix_cache,
        disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_overlap_schedule=args.disable_overlap_schedule,
        enable_deterministic_inference=args.enable_deterministic_inference,
        disable_fused_ops=args.disable_fused_ops, random_weights=args.random_weights, no_tuned=args.no_tuned,
        tp_size=args.tp_size, nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
    )


def run_other_node(args: argparse.Namespace) -> int:
    """`--node-rank` > 0: host this machine's tensor-parallel ranks until node 0 ends the world."""
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.tensor_parallel import run_node

    return run_node(EngineConfig(**engine_settings(args)))
