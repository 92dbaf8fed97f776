"""Compile the TMA prefill kernel for sm_90 on a machine without a GPU and read what ptxas says.

For each config: whether Triton built the warp-specialised form (a `ttg.warp_specialize` op), the
warps launched, the shared memory, and ptxas's registers / spills / wgmma-serialisation warnings.
Used to iterate on the kernel before spending GPU time on it.

    PYTHONPATH=src python3 tools/compile_prefill_tma_sm90.py [--configs 128,128,4,2,1 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from attnserve.attention.kernels.mha import prefill_tma as pt


def compile_config(cfg: pt.PrefillTmaConfig, head_dim: int = 128, group: int = 4, window: bool = False,
                   softcap: bool = False, sinks: bool = False, lse: bool = False) -> dict:
    x = torch.empty(4096, 8, head_dim, dtype=torch.bfloat16)  # stands in for q / k / v rows
    idx = torch.empty(16, dtype=torch.int32)
    if cfg.device_descriptors:
        operands = dict(Q=x, K=x, V=x)
    else:
        operands = dict(Q=pt._descriptor(x, cfg.block_m), K=pt._descriptor(x, cfg.block_n),
                        V=pt._descriptor(x, cfg.block_n))
    args = dict(operands, Out=x, Lse=torch.empty(16, dtype=torch.float32), tile_req=idx, tile_m0=idx, qo_indptr=idx, kv_starts=idx, seq_lens=idx, Sinks=x,
                qk_scale_log2=0.1, sm_scale_k=0.1, softcap=1.5, window=7, stride_ot=1024, stride_oh=128,
                stride_lt=8 * group, num_work=1000, q_rows=4096, kv_rows=4096, stride_qt=1024, stride_kt=1024, stride_vt=1024)
    constexprs = dict(NUM_HEADS=8 * group, NUM_KV_HEADS=8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      HEAD_DIM=head_dim, HAS_WINDOW=window, HAS_SOFTCAP=softcap, HAS_SINKS=sinks,
                      WARP_SPECIALIZE=cfg.warp_specialize, PERSISTENT=bool(cfg.persistent),
                      MASK_EVERY_TILE=cfg.mask_every_tile, DEVICE_DESC=cfg.device_descriptors,
                      KV_HEAD_MAJOR=cfg.kv_head_major, DOT_F32=False, HAS_LSE=lse)
    fn = pt._prefill_tma_kernel
    sig = {n: ("constexpr" if n in constexprs else mangle_type(args[n])) for n in fn.arg_names}
    row = {"config": cfg.__dict__, "head_dim": head_dim, "window": window, "softcap": softcap, "sinks": sinks,
           "lse": lse}
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is the finding
        return row | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    boxes = re.findall(r"tensormap_create %\w+, %\w+, \[(%c\d+_i32), (%c\d+_i32)\]", k.asm["ttgir"])
    return row | {"warp_specialized": "ttg.warp_specialize" in k.asm["ttgir"], "warps": k.metadata.num_warps,
                  "device_descriptor_boxes": [(a[2:-4], b[2:-4]) for a, b in boxes],
                  "host_descriptor_blocks": [m["block_size"] for m in k.metadata.tensordesc_meta or []],
                  "shared_kib": round(k.metadata.shared / 1024, 1), "registers": int(regs[0]) if regs else None,
                  "spill_bytes": int(spills[0]) if spills else None, "serialized_wgmma": "C7515" in res.stderr,
                  "fits_227k": k.metadata.shared <= 227 * 1024}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["128,128,4,2,1", "128,64,4,3,1", "128,64,4,2,1", "128,128,4,2,0"],
                   help="block_m,block_n,warps,stages,warp_specialize[,mask_every_tile[,persistent[,device_descriptors]]]")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--features", action="store_true", help="also compile with window, soft-cap and sinks")
    p.add_argument("--lse", action="store_true", help="also compile with the row LSE written (the training forward)")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (1: the training forward's one "
                   "head per request)")
    args = p.parse_args(argv)
    for text in args.configs:
        bm, bn, w, s, ws, *rest = (int(x) for x in text.split(","))
        cfg = pt.PrefillTmaConfig(bm, bn, w, s, bool(ws), bool(rest[0]) if rest else True,
                                  rest[1] if len(rest) > 1 else 0, bool(rest[2]) if len(rest) > 2 else bool(ws))
        variants = [{}] + ([{"window": True, "softcap": True, "sinks": True}] if args.features else [])
        variants += [{"lse": True}] if args.lse else []
        for extra in variants:
            print(compile_config(cfg, args.head_dim, args.group, **extra), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
