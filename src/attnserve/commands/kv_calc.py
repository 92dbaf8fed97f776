"""`attnserve kv-calc`: KV-cache size, max batch and attention arithmetic intensity for a model."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from attnserve.kvcache.calc import WEIGHT_DTYPE_BYTES, format_bytes, kv_cache_report
from attnserve.models.config import attention_shape_of, stated_dtype_of
from attnserve.presets import PRESETS


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "kv-calc",
        help="KV-cache bytes per token, cache size, max batch, arithmetic intensity",
        description="KV-cache arithmetic for a preset or a Hugging Face config.json. Presets: "
        + ", ".join(sorted(PRESETS)),
    )
    p.add_argument("--model", required=True, help="preset name, path to a config.json (or its directory) or a .gguf file")
    p.add_argument("--context", type=int, required=True, help="tokens per request (prompt + output)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests (default 1)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (default: as the engine on a GPU, the model dtype: the checkpoint's, bf16 if it "
                   "states none), bf16, fp16, fp32, fp8_e4m3 or fp8_e5m2")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", *sorted(WEIGHT_DTYPE_BYTES)],
                   help="bytes per weight for sizing the model beside the cache (default auto: the model dtype, "
                   "as for the KV cache)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory in GB (10^9 bytes); reports the max batch that fits beside the weights")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel size: report one rank's share (its heads' cache, 1/tp of the weights; "
                   "--gpu-memory-gb is then one GPU's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def run(args) -> int:
    shape = attention_shape_of(args.model)
    report = kv_cache_report(args.model, shape, args.context, args.batch, args.kv_cache_dtype,
                             args.gpu_memory_gb, args.weight_dtype, args.tp_size, stated_dtype_of(args.model))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print_table(report)
    return 0


def _print_table(r) -> None:
    heads = f"{r.num_q_heads} query heads, {r.num_kv_heads} KV heads, K {r.head_dim} / V {r.v_head_dim} wide"
    if r.attention_type == "MLA":
        heads = f"{r.num_q_heads} query heads over one latent KV head ({r.head_dim} wide, V = first {r.v_head_dim})"
    rank = f", one of {r.tp_size} tensor-parallel ranks" if r.tp_size > 1 else ""
    table = Table(title=f"KV cache: {r.model} ({r.attention_type}, {r.kv_cache_dtype}{rank})", show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    table.add_row("layers / heads", f"{r.num_layers} layers; {heads}")
    if r.sliding_window:
        table.add_row("sliding window", f"{r.sliding_window} tokens (full-context cache counted below)")
    table.add_row("bytes per token, one layer", format_bytes(r.bytes_per_token_per_layer))
    table.add_row("bytes per token", f"{format_bytes(r.bytes_per_token)} ({r.bytes_per_token:,} B)")
    table.add_row("per request", f"{format_bytes(r.bytes_per_request)} at {r.context:,} tokens")
    table.add_row("total cache", f"{format_bytes(r.total_bytes)} for {r.batch} x {r.context:,} tokens")
    table.add_row("weights", f"{format_bytes(r.weight_bytes)} ({r.num_params / 1e9:.2f}B params, {r.weight_dtype})")
    if r.max_batch is not None:
        table.add_row("max batch", f"{r.max_batch} requests of {r.context:,} tokens in "
                                   f"{r.gpu_memory_bytes / 1e9:g} GB beside the weights")
    table.add_row("decode attention intensity", f"{r.decode_intensity:.1f} FLOP/byte")
    table.add_row("prefill attention intensity", f"{r.prefill_intensity:.1f} FLOP/byte")
    if r.decode_step_intensity is not None:
        table.add_row("decode step intensity (whole model)", f"{r.decode_step_intensity:.1f} FLOP/byte")
    Console().print(table)
