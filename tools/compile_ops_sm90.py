"""Compile the fused ops' Triton kernels for sm_90 on a machine without a GPU: what the interpreter cannot check.

The CPU tests run these kernels interpreted, which accepts code the GPU compiler refuses (a type the MLIR
verifier rejects, an inline-asm instruction the target lacks). This compiles each kernel as the engine
launches it at DeepSeek-V2-Lite's and Llama-3-8B's shapes, with programmatic dependent launch on and off and
the one-token MoE path, through Triton and its ptxas, and reports registers and spills per kernel.

    python tools/compile_ops_sm90.py            # a table
    python tools/compile_ops_sm90.py --json     # one JSON object: {kernel case: {registers, spill_bytes, ...}}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from compile_mla_sm90 import compile_sm90  # noqa: E402

BF16 = "*bf16"


def cases() -> dict:
    """case name -> (kernel, constexprs, pointer and float types, num_warps, num_stages)."""
    from attnserve.ops.kernels import (
        fused_moe,
        mla_absorb,
        mla_rope,
        moe_align,
        moe_route,
        rmsnorm,
        rope_store,
        silu_mul,
    )

    moe = {"TOP_K": 6, "CHOICES": 8, "NUM_EXPERTS": 64, "NUM_SHARED": 2, "BLOCK_M": 16, "BLOCK_N": 64,
           "BLOCK_K": 128, "EVEN_K": True, "EVEN_N": True, "DOT_F32": False}
    moe_types = {"X": BF16, "H": BF16, "W": BF16, "WS": BF16, "SortedPairs": "*i32", "BlockExpert": "*i32",
                 "Ids": "*i64", "RoutingWeights": "*fp32"}
    align = {"TOP_K": 6, "CHOICES": 8, "NUM_ROUTED": 64, "NUM_EXPERTS": 66, "E_PAD": 128, "BLOCK_M": 16}
    align_types = {"Ids": "*i64", "SortedPairs": "*i32", "BlockExpert": "*i32"}
    mla_types = {"QLatent": BF16, "QNope": BF16, "QPe": BF16, "WUK": BF16, "Latent": BF16, "KPe": BF16,
                 "NormW": BF16, "Cos": BF16, "Sin": BF16, "QFull": BF16, "KVRow": BF16, "eps": "fp32"}
    mla = {"RANK": 512, "BLOCK_RANK": 512, "ROPE": 64, "BLOCK_HALF": 32, "INTERLEAVED": True}
    out = {}
    for pdl in (False, True):
        tag = "+pdl" if pdl else ""
        for one_token in (False, True):
            name = "one token" if one_token else "aligned"
            out[f"moe gate_up {name}{tag}"] = (fused_moe._gate_up_silu_kernel, {**moe, "ONE_TOKEN": one_token,
                                               "PDL": pdl}, {**moe_types, "Out": BF16}, 4, 4)
            out[f"moe down {name}{tag}"] = (fused_moe._down_weighted_kernel, {**moe, "ONE_TOKEN": one_token,
                                            "PDL": pdl}, {**moe_types, "Out": "*fp32"}, 4, 4)
        out[f"moe sum top-k{tag}"] = (fused_moe._sum_top_k_kernel, {"TOP_K": 8, "BLOCK": 1024, "HAS_ADD": False,
                                      "PDL": pdl}, {"Weighted": "*fp32", "Add": BF16, "Out": BF16}, 4, 1)
        out[f"align one program{tag}"] = (moe_align._align_kernel, {**align, "CHUNK": 128, "FILL_CHUNK": 1024,
                                          "PDL": pdl}, align_types, 4, 1)
        out[f"align per expert{tag}"] = (moe_align._align_per_expert_kernel, {**align, "CHUNK": 128, "PDL": pdl},
                                         align_types, 4, 1)
        out[f"route{tag}"] = (moe_route._route_kernel, {"E": 64, "E_PAD": 64, "TOP_K": 6, "K_PAD": 8, "BLOCK_K": 128,
                              "SPLIT": 16, "SOFTMAX": True, "NORMALISE": False, "PDL": pdl},
                              {"X": BF16, "W": "*fp32", "Partial": "*fp32", "Counter": "*i32", "Weights": "*fp32",
                               "Ids": "*i64", "scale": "fp32"}, 4, 1)
        out[f"mla absorb{tag}"] = (mla_absorb._mla_absorb_kernel, {**mla, "NOPE": 128, "BLOCK_NOPE": 128,
                                   "BLOCK_R": 64, "PDL": pdl}, mla_types, 4, 1)
        out[f"mla rope{tag}"] = (mla_rope._mla_rope_kernel, {**mla, "H": 16, "BLOCK_H": 16, "PDL": pdl}, mla_types,
                                 4, 1)
        out[f"add rmsnorm{tag}"] = (rmsnorm._rmsnorm_kernel, {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True,
                                    "PDL": pdl}, {n: BF16 for n in ("X", "R", "W", "Out", "R_out")} | {"eps": "fp32"},
                                    8, 1)
        out[f"silu mul{tag}"] = (silu_mul._silu_mul_kernel, {"N": 14336, "BLOCK": 1024, "PDL": pdl},
                                 {"GateUp": BF16, "Out": BF16}, 4, 1)
        out[f"rope store{tag}"] = (rope_store._rope_store_kernel, {"HQ": 32, "HK": 8, "BLOCK_HQ": 32, "BLOCK_HK": 8,
                                   "D": 128, "R": 128, "BLOCK_HALF": 64, "BLOCK_PASS": 0, "DV": 128, "BLOCK_DV": 128,
                                   "INTERLEAVED": False, "PDL": pdl},
                                   {n: BF16 for n in ("Q", "K", "V", "Q_out", "K_out", "K_buf", "V_buf")}
                                   | {"Cos": BF16, "Sin": BF16, "loc": "*i64"}, 4, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {}
    for name, (kernel, constexprs, types, warps, stages) in cases().items():
        r = compile_sm90(kernel, constexprs, warps, stages, pointers=types)
        report[name] = {k: r[k] for k in ("registers", "spill_bytes", "smem_kib", "grid_dependency_control")}
        if not args.json:
            print(f"{name:28} {r['registers']:4d} registers  spills {r['spill_bytes']}  smem {r['smem_kib']} KiB  "
                  f"griddepcontrol {r['grid_dependency_control']}", flush=True)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
