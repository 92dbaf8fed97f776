"""Compile the Gluon prefill kernel for sm_90 on a machine without a GPU and read what ptxas says of it.

Gluon does not run under the Triton interpreter, so this is the CPU's check of the kernel: that it
builds for Hopper at all, its registers and spills (ptxas), shared memory, the partitions' warps and
register moves (setmaxnreg), and the wgmma, TMA and mbarrier instructions in its PTX
(compile_mla_sm90.compile_sm90 does the compiling). The GPU tests check what it computes.

    python3 tools/compile_prefill_gluon_sm90.py [--dtype fp16] [--pingpong] [--indirect] [--set NAME=VALUE[,...]]
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

import torch  # noqa: E402
from compile_mla_sm90 import compile_sm90  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from attnserve.attention.kernels.mha import prefill_gluon as pg  # noqa: E402
from attnserve.attention.kernels.mha.gluon_switches import gluon_settings  # noqa: E402


def compile_report(dtype: torch.dtype = torch.bfloat16, group: int = 4, pingpong: bool = False,
                   indirect: bool = False, switches: str = "") -> dict:
    """indirect: the loader reading K and V rows through a slot list (cp.async) instead of TMA; switches: the
    module's switches set so while it builds ("PINGPONG=0,STAGES=3", gluon_switches.gluon_settings)."""
    with gluon_settings(switches):
        return {"dtype": str(dtype), "group": group, "pingpong": pingpong, "indirect": indirect,
                "switches": switches, **_compile(dtype, group, pingpong, indirect)}


def _compile(dtype: torch.dtype, group: int, pingpong: bool, indirect: bool) -> dict:
    kv_heads, head_dim = 8, 128
    q = torch.empty(4096, kv_heads * group, head_dim, dtype=dtype)  # stands in for the query rows
    kv = torch.empty(4096, kv_heads, head_dim, dtype=dtype)  # and for the K / V rows
    kv_type = mangle_type(kv) if indirect else mangle_type(pg._descriptor(kv, pg.BLOCK_N))
    types = {"q_desc": mangle_type(pg._descriptor(q, pg.BLOCK_M // 2)), "k_src": kv_type, "v_src": kv_type,
             "Out": mangle_type(q), "kv_starts": "*i32", "slots": "*i32", "counter": "*i32"}
    constexprs = dict(NUM_HEADS=kv_heads * group, NUM_KV_HEADS=kv_heads, BLOCK_M=pg.BLOCK_M, BLOCK_N=pg.BLOCK_N,
                      HEAD_DIM=head_dim, STAGES=pg.STAGES,
                      CONSUMER_REGS=pg.INDIRECT_CONSUMER_REGS if indirect else pg.CONSUMER_REGS, PINGPONG=pingpong,
                      INDIRECT=indirect, KV_LAYOUT=pg._shared_layout(dtype, pg.BLOCK_N, head_dim),
                      LOADER_WARPS=pg.LOADER_WARPS, ROW_LANES=pg.INDIRECT_ROW_LANES,
                      DYNAMIC_ITEMS=pg.DYNAMIC_ITEMS)
    return compile_sm90(pg._prefill_gluon_kernel, constexprs, pg.LOADER_WARPS, 1, source=GluonASTSource,
                        pointers=types)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--pingpong", action="store_true", help="the consumers taking turns to issue their MMAs")
    p.add_argument("--indirect", action="store_true", help="K and V rows read through a slot list (cp.async)")
    p.add_argument("--set", default="", metavar="NAME=VALUE[,NAME=VALUE]",
                   help="the module's switches while it builds, e.g. STAGES=3")
    args = p.parse_args(argv)
    print(json.dumps(compile_report(torch.bfloat16 if args.dtype == "bf16" else torch.float16, args.group,
                                    args.pingpong, args.indirect, args.set)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
