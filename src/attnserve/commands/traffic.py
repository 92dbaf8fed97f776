"""`attnserve traffic`: HBM bytes and arithmetic intensity of attention, naive against FlashAttention against
the lower bound, and where the roofline puts each."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from attnserve._lazy import require
from attnserve.analysis.traffic import (
    FORMS,
    GPU_CEILINGS,
    ORDERS,
    Tile,
    backward_bytes,
    bytes_against_t,
    gpu_ceilings,
    traffic_report,
)
from attnserve.kvcache.calc import format_bytes
from attnserve.models.config import attention_shape_of
from attnserve.presets import PRESETS

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "traffic",
        help="HBM traffic and roofline of attention: naive, FlashAttention (tile from on-chip memory), lower bound",
        description="HBM bytes, FLOPs and arithmetic intensity of one attention layer's forward and backward for a "
        "preset or a Hugging Face config.json, in three forms: naive (S and P materialised), FlashAttention "
        "(tile Br x Bc from the GPU's on-chip memory M) and the lower bound; and where the GPU's roofline puts "
        "each. Presets: " + ", ".join(sorted(PRESETS)) + ". GPUs: " + ", ".join(sorted(GPU_CEILINGS)),
    )
    p.add_argument("--model", required=True, help="preset name or path to a config.json (or its directory)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (queries = keys)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--gpu", default=None, help="GPU preset (default: the GPU this machine has)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="activation dtype (default bf16)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full (bidirectional) attention")
    p.add_argument("--sram-kib", type=int, default=None,
                   help="on-chip memory M per multiprocessor in KiB (default: the GPU's); sets the tile")
    p.add_argument("--tile", default=None, metavar="BRxBC", help="the FlashAttention tile instead of the one from M")
    p.add_argument("--order", default="paper", choices=ORDERS,
                   help="FlashAttention loop order: the paper's (K/V blocks outer) or rows (query blocks outer, "
                   "as attnserve's kernels) (default paper)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--png", default=None, metavar="PATH", help="also draw forward and backward bytes against T")
    return p


def run(args) -> int:
    shape = attention_shape_of(args.model)
    gpu = gpu_ceilings(args.gpu)
    if args.sram_kib is not None:
        if args.sram_kib < 1:
            raise ValueError(f"--sram-kib must be >= 1, got {args.sram_kib}")
        gpu = replace(gpu, sram_kib=args.sram_kib)
    tile = _parse_tile(args.tile, Tile) if args.tile else None
    report = traffic_report(str(args.model), shape, args.seq_len, args.batch, gpu, args.causal,
                            DTYPE_BYTES[args.dtype], tile, args.order)
    if args.png:
        _draw(args.png, shape, gpu, report, args)
    if args.json:
        d = report.as_dict()
        if args.png:
            d["png"] = args.png
        print(json.dumps(d, indent=2))
    else:
        _print_table(report)
        if args.png:
            print(f"wrote {args.png}")
    return 0


def _parse_tile(text: str, tile_cls):
    try:
        br, bc = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--tile must look like 128x64, got {text!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"--tile sizes must be >= 1, got {text!r}")
    return tile_cls(br=br, bc=bc)


def _print_table(r) -> None:
    mask = "causal" if r.causal else "full"
    title = (f"Attention HBM traffic: {r.model}, T={r.seq_len:,} x batch {r.batch}, {mask}, one layer "
             f"of {r.num_layers}, on {r.gpu}")
    table = Table(title=title)
    for col in ("pass", "form", "HBM bytes", "GFLOP", "FLOP/B", "roofline", "bound", "time"):
        table.add_column(col, justify="left" if col in ("pass", "form", "bound") else "right", no_wrap=True)
    names = {"naive": "naive", "flash": f"flash {r.tile_br}x{r.tile_bc}", "lower_bound": "lower bound"}
    for label, forms in (("forward", r.forward), ("backward", r.backward)):
        for key, f in forms.items():
            table.add_row(label, names[key], format_bytes(f.bytes), f"{f.flops / 1e9:,.1f}", f"{f.intensity:,.1f}",
                          f"{f.attainable_tflops:,.0f} TFLOP/s", f.bound, f"{f.time_us:,.0f} us")
            label = ""
    console = Console()
    console.width = max(console.width, 100)  # the eight columns need about 96 (a pipe defaults to 80)
    console.print(table)
    order = "K/V blocks outer (the paper's)" if r.order == "paper" else "query blocks outer"
    console.print(
        f"naive: S and P in HBM; flash: tiled, nothing T x T in HBM. {r.num_q_heads} query heads / "
        f"{r.num_kv_heads} KV heads of {r.head_dim}; one T x T score matrix per head: "
        f"{format_bytes(r.score_matrix_bytes_per_head)}. Tile from M = {r.sram_kib} KiB on chip: "
        f"Br={r.tile_br}, Bc={r.tile_bc}, {order}. Roofline: {r.peak_tflops:g} TFLOP/s, {r.hbm_tb_s:g} TB/s, "
        f"ridge {r.ridge:.0f} FLOP/byte.")


def _draw(path: str, shape, gpu, report, args) -> None:
    matplotlib = require("matplotlib", "attnserve traffic --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tile = Tile(report.tile_br, report.tile_bc)
    top = max(2 * args.seq_len, 32768)
    seq_lens = [t for t in (2 ** i for i in range(8, 20)) if t <= top]
    fwd = bytes_against_t(shape, seq_lens, gpu, args.causal, report.elem_bytes, tile, args.order)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"naive": "tab:red", "flash": "tab:blue", "lower_bound": "tab:green"}
    for form in FORMS:
        bwd = [backward_bytes(t, shape.head_dim, shape.v_head_dim, report.elem_bytes, tile, args.causal,
                              shape.num_q_heads, shape.num_kv_heads, args.order)[form] for t in seq_lens]
        ax.plot(seq_lens, [b * args.batch for b in fwd[form]], "-o", color=styles[form], ms=3,
                label=f"{form.replace('_', ' ')} forward")
        ax.plot(seq_lens, [b * args.batch for b in bwd], "--", color=styles[form], label=f"{form.replace('_', ' ')} backward")
    ax.axvline(args.seq_len, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("HBM bytes, one layer")
    ax.set_title(f"{report.model} on {gpu.name}: tile {tile.br}x{tile.bc}, batch {args.batch}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
