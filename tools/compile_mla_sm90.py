"""Compile the Triton MLA kernels for sm_90 on a machine without a GPU and report what ptxas and the TTGIR say.

Per tile: registers, spill bytes, shared memory, whether the latent loads are pipelined (async copies), and the
Hopper MMA layouts (warpsPerCTA [8, 1] on a 64-row score tile means both warpgroups compute all of it).

    python tools/compile_mla_sm90.py                   # the shipped sm90 tiles and the sweep's new ones
    python tools/compile_mla_sm90.py --decode 64,32,8,2,1,64   # block_h,block_n,warps,stages,defer_pv,page
    python tools/compile_mla_sm90.py --gluon 1 --json          # the Gluon decode kernel over 1-token pages
    python tools/compile_mla_sm90.py --gluon 64 --gluon-kernel gluon_narrow --gluon-heads 16 --json

Pointers and strides are declared 16-divisible, as Triton's launcher specialises them at run time (576-wide
bf16 rows): without that hint the pipeliner cannot use 16-byte async copies and compiles nothing like what runs.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {"Q": "*bf16", "KV": "*bf16", "Out": "*bf16", "PartialO": "*fp32", "PartialLse": "*fp32",
            "kv_indptr": "*i32", "kv_indices": "*i32", "seq_lens": "*i32", "num_splits": "*i32",
            "tile_req": "*i32", "tile_m0": "*i32", "qo_indptr": "*i32", "Mask": "*u8", "mask_indptr": "*i64",
            "group_first": "*i32", "group_ntok": "*i32"}
FLOATS = {"qk_scale_log2", "v_scale"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int, source=ASTSource, pointers=None,
                 **options) -> dict:
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    constexprs = {**{n: q.default for n, q in params.items()  # constexprs left at their defaults
                     if "constexpr" in str(q.annotation) and q.default is not inspect.Parameter.empty},
                  **constexprs}
    types = {**POINTERS, **(pointers or {})}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "fp32" if n in FLOATS else "i32")
                 for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n.startswith("stride")}
    kernel = triton.compile(source(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps, "num_stages": num_stages, **options})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path  # the one whose version chose the PTX's (a CUDA toolkit's may be newer)
        proc = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True)
    info = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    if proc.returncode != 0 or regs is None or spills is None:
        raise RuntimeError(f"ptxas ({ptxas}) exited {proc.returncode} without a register and spill report:\n"
                           f"{info[-2000:]}")
    ttgir = kernel.asm["ttgir"]
    return {"registers": int(regs.group(1)),
            # ptxas's C7512: it waits on every wgmma when the accumulators in flight do not fit the registers
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info,
            "spill_bytes": tuple(map(int, spills.groups())),
            "smem_kib": round(kernel.metadata.shared / 1024, 1),
            "grid_dependency_control": kernel.asm["ptx"].count("griddepcontrol."),  # PDL's wait and release
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "tma_loads": kernel.asm["ptx"].count("cp.async.bulk.tensor"),
            "tma_reductions": kernel.asm["ptx"].count("cp.reduce.async.bulk.tensor"),
            "warps": kernel.metadata.num_warps,  # a warp-specialised kernel's partitions included
            # setmaxnreg's register moves between partitions, and the mbarrier traffic of warp-specialised kernels
            "setmaxnreg": sorted({" ".join(m.split()) for m in
                                  re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", kernel.asm["ptx"])}),
            "mbarrier_arrives": kernel.asm["ptx"].count("mbarrier.arrive"),
            "mbarrier_waits": kernel.asm["ptx"].count("mbarrier.try_wait"),
            "wgmma_operand_rewrites": wgmma_operand_rewrites(kernel.asm["ptx"]),
            "loads_used_in_block": loads_used_in_block(kernel.asm["ptx"]),
            "mma_sync": kernel.asm["ptx"].count("mma.sync"),
            "global_stores": dict(sorted(collections.Counter(re.findall(r"st\.global[\w.]*", kernel.asm["ptx"])).items())),
            "mma": re.findall(r"warpsPerCTA = \[(\d+, \d+)\], instrShape = \[([\d, ]+)\]", ttgir),
            "wgmma": {m: kernel.asm["ptx"].count(m) for m in sorted(set(re.findall(r"wgmma\.mma_async\S*?(m64n\d+k\d+)",
                                                                                 kernel.asm["ptx"])))}}


def loads_used_in_block(ptx: str) -> int:
    """32-bit global loads whose value is read before their basic block ends (a branch or a block label): the warp
    waits for each of those loads there, a global load's latency, since ptxas does not move the read past the
    block's end."""
    lines = [line.strip() for line in ptx.splitlines()]
    used = 0
    for i, line in enumerate(lines):
        m = re.search(r"ld\.global\.b32\s+\{\s*(%r\d+)\s*\}", line)
        if not m:
            continue
        reg = re.compile(re.escape(m.group(1)) + r"(?!\d)")
        for later in lines[i + 1:]:
            if re.match(r"(@!?%p\d+\s+)?bra", later) or re.match(r"\$L__BB\d+_\d+:", later):
                break
            if not later.startswith("//") and reg.search(later):
                used += 1
                break
    return used


def wgmma_operand_rewrites(ptx: str) -> list[str]:
    """PTX lines that write an A-operand register of a wgmma taking A from registers before a `wgmma.wait_group 0`
    follows it: PTX leaves the MMA's result undefined then (a conservative reading: the lines in order, branches
    and all, up to the next wait for every group)."""
    lines = ptx.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"wgmma\.mma_async\.sync\.aligned\.\S+\s+\{[^}]*\},\s*\{([^}]*)\}", line)
        if not m:
            continue
        a_regs = {r.strip() for r in m.group(1).split(",")}
        for later in lines[i + 1:]:
            text = later.strip()
            if "wgmma.wait_group.sync.aligned 0" in text:
                break
            d = re.match(r"(?:@!?%p\d+\s+)?[a-z][\w.:]*\s+(%r\d+|\{[^}]*\})\s*,", text)
            if d and not text.startswith("wgmma") and set(re.findall(r"%r\d+", d.group(1))) & a_regs:
                found.append(text)
                break
    return found


def decode_report(block_h, block_n, warps, stages, defer_pv, page_size, heads=128) -> dict:
    from attnserve.attention.kernels.mla.decode import mla_decode_split_kernel

    return compile_sm90(mla_decode_split_kernel, dict(
        NUM_HEADS=heads, BLOCK_H=block_h, BLOCK_N=block_n, LATENT=512, ROPE=64, BLOCK_R=64, PAGE_SIZE=page_size,
        TILE_IN_PAGE=page_size % block_n == 0, DEFER_PV=bool(defer_pv), WRITE_FINAL=False, DOT_F32=False),
        warps, stages)


def extend_report(block_m, block_n, warps, stages, defer_pv, page_size=1) -> dict:
    from attnserve.attention.kernels.mla.extend import mla_extend_kernel

    return compile_sm90(mla_extend_kernel, dict(
        BLOCK_M=block_m, BLOCK_N=block_n, LATENT=512, ROPE=64, BLOCK_R=64, PAGE_SIZE=page_size,
        HAS_CUSTOM_MASK=False, DEFER_PV=bool(defer_pv), DOT_F32=False), warps, stages)


def gluon_report(page_size, heads=128, kernel="gluon_seesaw", scaled=False) -> dict:
    """A warp-specialised Gluon decode kernel at its register budgets: the seesaw (fewer heads: the extend rows'
    token groups, plan.tokens_per_cta), the narrow one (its CTA's heads: the fewest of 16 / 32 that hold them)
    or the scorer (scaled: its float16 partials)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from attnserve.attention.kernels.mla.gluon import launch as g

    common = {"NUM_HEADS": heads, "LATENT": 512, "ROPE": 64, "PAGE_SIZE": page_size, "WRITE_FINAL": False}
    if kernel == "gluon_narrow":
        return compile_sm90(g.mla_decode_narrow_kernel, {**common, "BLOCK_H": 16 if heads <= 16 else 32,
                                                          "CONSUMER_REGS": g.NARROW_CONSUMER_REGS},
                            4, 1, source=GluonASTSource, maxnreg=g.MAXNREG)
    constexprs = {**common, "CONSUMER_REGS": g.CONSUMER_REGS, "TOKENS": g.tokens_per_cta(heads)}
    if kernel == "gluon_scorer":  # over 64-token pages its tiles come by TMA: the latent's
        # descriptor type
        import torch
        from triton.runtime.jit import mangle_type

        pointers = {"PartialO": "*fp16"} if scaled else {}
        constexprs = {**constexprs, "CONSUMER_REGS": g.SCORER_REGS, "TOKENS": 1, "SCALED": scaled}
        if page_size % g.GLUON_BLOCK_N == 0:
            pointers["kv_desc"] = mangle_type(g.latent_descriptor(torch.empty(64, 1, 576, dtype=torch.bfloat16)))
        else:
            constexprs["kv_desc"] = None
        return compile_sm90(g.mla_decode_scorer_kernel, constexprs, 4, 1, source=GluonASTSource, pointers=pointers)
    return compile_sm90(g.mla_decode_seesaw_kernel, {**constexprs, **g.seesaw_switches()}, 4, 1,
                        source=GluonASTSource, maxnreg=g.MAXNREG)


DECODE = [(64, 64, 8, 2, 0, 64), (32, 64, 4, 2, 0, 1), (16, 64, 4, 2, 0, 64), (64, 32, 8, 2, 1, 64),
          (64, 32, 8, 2, 1, 1), (64, 16, 8, 3, 1, 1), (16, 32, 4, 4, 0, 64)]
EXTEND = [(32, 32, 4, 2, 0), (64, 32, 8, 2, 1), (64, 32, 8, 2, 0)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", action="append", help="block_h,block_n,warps,stages,defer_pv,page_size")
    p.add_argument("--extend", action="append", help="block_m,block_n,warps,stages,defer_pv")
    p.add_argument("--gluon", action="append", type=int, metavar="PAGE_SIZE", help="the Gluon decode kernel")
    p.add_argument("--gluon-heads", type=int, default=128, help="with --gluon: query heads (16: 4-token rows)")
    p.add_argument("--gluon-kernel", default="gluon_seesaw", choices=("gluon_seesaw", "gluon_scorer", "gluon_narrow"))
    p.add_argument("--scaled", action="store_true", help="gluon_scorer: float16 partials")
    p.add_argument("--set", default="", metavar="NAME=VALUE[,...]",
                   help="with --gluon: the Gluon launch's switches while it builds, e.g. SEESAW_WHOLE_TILES=1")
    p.add_argument("--json", action="store_true", help="one JSON object per line (the Gluon rows)")
    args = p.parse_args()
    if args.gluon:
        from attnserve.attention.kernels.mha.gluon_switches import MLA_DECODE, gluon_settings

        with gluon_settings(args.set, MLA_DECODE):
            for page in args.gluon:
                report = {"kernel": args.gluon_kernel, "page_size": page, "heads": args.gluon_heads,
                          "scaled": args.scaled, "switches": args.set,
                          **gluon_report(page, args.gluon_heads, args.gluon_kernel, args.scaled)}
                print(json.dumps(report) if args.json else report, flush=True)
        return 0
    decode = [tuple(map(int, s.split(","))) for s in args.decode or []]
    extend = [tuple(map(int, s.split(","))) for s in args.extend or []]
    if not decode and not extend:
        decode, extend = DECODE, EXTEND
    for kind, rows, report in (("decode", decode, decode_report), ("extend", extend, extend_report)):
        for row in rows:
            try:
                print(kind, row, report(*row), flush=True)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
                print(kind, row, "error:", str(exc).splitlines()[-1][:200], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
