"""A timeline of the column-split MLA decode at one long request (1 x 32768, 128 heads, page 1) and its merge:
where a CTA's fixed cost (F, about 6.7 us of the kernel's 25.4, benchmarks/NOTES.md) goes.

The shipped kernels, copied with clock stamps added (a patched source, as mla_split_cost.patched_seesaw does):
each warpgroup of each CTA records %clock64 at its start, when tile 0 and the query have landed, at the end of
every tile, after the loop's last copy wait, after the two warpgroups' epilogue handshake and after its stores,
plus the phases of one mid-loop tile, and %globaltimer at its start and end (and %smid); each merge program its
%globaltimer at start and end. The stamps come from the last call of a CUDA graph of 20 (decode + merge) calls,
as the race times them, so one call's merge precedes the next call's decode. The group_ntok argument, unused at
one token a CTA, carries the stamp buffer.

    PYTHONPATH=src python3 benchmarks/mla_colsplit_timeline.py [--json out.json]
    PYTHONPATH=src python3 benchmarks/mla_colsplit_timeline.py --compile-only   # no GPU: sm_90 compile reports

The stamps must not change what they time: --compile-only compiles every stamped variant for sm_90 (the CPU
tests check it keeps the shipped kernel's registers, no spills and asynchronous wgmmas).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import tempfile

import torch
import triton
from mla_split_cost import HEADS, WIDTH, inputs, write_json  # a sibling script

import attnserve.attention.kernels.mla_decode_colsplit as colsplit
from attnserve.attention.kernels import merge_tiled
from attnserve.attention.kernels.decode import partial_strides
from attnserve.attention.kernels.mla_decode_gluon import COLSPLIT_REGS, GLUON_LATENT, GLUON_ROPE, LOG2E
from attnserve.bench.timing import time_call

SPLITS, SEQ = 64, 32768
SLOTS = 40  # int64 stamps a warpgroup
# slots: 0 start, 1 tile 0 landed, 2 + t end of tile t (t < 16), 18-21 tile MID's phases, 22 after the last copy
# wait, 23 after the epilogue handshake, 24 after the stores, 30 %globaltimer at start, 31 at the end, 32 %smid
MID = 3
PHASES = {18: "tile landed", 19: "own half of the score done", 20: "halves met (wg0: other half read; wg1: "
          "its half published)", 21: "probabilities out (wg0) / in (wg1)"}

STAMP = '''
@gluon.jit
def _stamp(TL, b, hg, split, W: gl.constexpr, SLOT: gl.constexpr, GLOBAL: gl.constexpr = False):
    if GLOBAL:
        v = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    else:
        v = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(TL + ((b * 64 + split) * 2 + hg) * 80 + W * 40 + SLOT, v)


@gluon.jit
def _colsplit_warpgroup('''

EDITS = [  # (old, new): each old must occur exactly as many times as counted
    ("\n@gluon.jit\ndef _colsplit_warpgroup(", STAMP, 1),
    ("def _colsplit_warpgroup(\n    Q, KV,", "def _colsplit_warpgroup(\n    TL, Q, KV,", 1),
    ("(_colsplit_warpgroup, (Q, KV,", "(_colsplit_warpgroup, (group_ntok, Q, KV,", 2),
    ("    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)\n",
     "    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)\n    _stamp(TL, b, hg, split, W, 30, True)\n"
     "    _stamp(TL, b, hg, split, W, 0)\n"
     "    smid = gl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [], dtype=gl.int32, is_pure=True, pack=1)\n"
     "    gl.store(TL + ((b * 64 + split) * 2 + hg) * 80 + W * 40 + 32, smid.to(gl.int64))\n", 1),
    ("        fence_async_shared()  # cp.async's writes before the wgmmas read them\n",
     "        fence_async_shared()  # cp.async's writes before the wgmmas read them\n"
     "        if t == 0:\n            _stamp(TL, b, hg, split, W, 1)\n"
     f"        if t == {MID}:\n            _stamp(TL, b, hg, split, W, 18)\n", 1),
    ("            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n            mbarrier.wait(x_ready, t & 1)\n"
     "            s = s + x_smem.load(s_layout)  # + warpgroup 1's columns and rope\n",
     "            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n"
     f"            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 19)\n"
     "            mbarrier.wait(x_ready, t & 1)\n"
     "            s = s + x_smem.load(s_layout)  # + warpgroup 1's columns and rope\n"
     f"            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 20)\n", 1),
    ("            _release(p_ready)\n",
     f"            _release(p_ready)\n            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 21)\n", 1),
    ("            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n            mbarrier.wait(x_free",
     "            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))\n"
     f"            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 19)\n"
     "            mbarrier.wait(x_free", 1),
    ("            _release(x_ready)\n            mbarrier.wait(p_ready, t & 1)\n",
     f"            _release(x_ready)\n            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 20)\n"
     "            mbarrier.wait(p_ready, t & 1)\n"
     f"            if t == {MID}:\n                _stamp(TL, b, hg, split, W, 21)\n", 1),
    ("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n",
     "        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n"
     "        if t < 16:\n            _stamp(TL, b, hg, split, W, 2 + t)\n", 1),
    ("    async_copy.wait_group(0)  # no copy outlives the CTA",
     "    async_copy.wait_group(0)\n    _stamp(TL, b, hg, split, W, 22)  # no copy outlives the CTA", 1),
    ("def _finish(acc,", "def _finish(TL, acc,", 1),  # the epilogue (the scorer kernel's too) gets the buffer
    ("    _finish(acc, l_i,", "    _finish(TL, acc, l_i,", 1),
    ("    inv_l = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)",
     "    _stamp(TL, b, hg, split, W, 23)\n    inv_l = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)", 1),
    ("W * HALF, NUM_HEADS, 1, BLOCK_H, HALF, WRITE_FINAL)\n",
     "W * HALF, NUM_HEADS, 1, BLOCK_H, HALF, WRITE_FINAL)\n    _stamp(TL, b, hg, split, W, 24)\n"
     "    _stamp(TL, b, hg, split, W, 31, True)\n", 1),
]

# variants: edits of the stamped source, each a question about the fixed cost
VARIANTS = {
    "shipped": [],
    # the query's share of the fill: its copies predicated off (zeros land; timing only)
    "no query copies": [
        ("_copy_columns(q_c_smem, q_ptrs, W * (HALF // ROPE), HALF // ROPE, ROPE, q_mask)",
         "_copy_columns(q_c_smem, q_ptrs, W * (HALF // ROPE), HALF // ROPE, ROPE, q_mask & (stride_qb < 0))", 1),
    ],
    # the epilogue: staged through shared memory but not stored / neither
    "no partial stores": [
        ("    _store_output(acc * inv_l[:, None], c_ring.index(W), Out, PartialO, b, 1, hg, split, active,",
         "    _store_output(acc * inv_l[:, None], c_ring.index(W), Out, PartialO, b, 1, hg, split, "
         "active & (stride_ps < 0),", 1),
    ],
    "no staging, no stores": [
        ("    _store_output(acc * inv_l[:, None],", "    if stride_ps < 0:\n        _store_output(acc * inv_l[:, None],", 1),
    ],
}

MERGE_EDITS = [
    ("import triton.language as tl\n", "import triton.language as tl\nfrom triton.language.extra.cuda import globaltimer\n", 1),
    ("    Out, PartialO, PartialLse, num_splits, v_scale,\n", "    Out, PartialO, PartialLse, num_splits, v_scale, TLM,\n", 1),
    ("    b = tl.program_id(0)\n    h = tl.program_id(1)\n",
     "    b = tl.program_id(0)\n    h = tl.program_id(1)\n    slot = TLM + ((b * tl.num_programs(1) + h) * "
     "tl.num_programs(2) + tl.program_id(2)) * 2\n    tl.store(slot, globaltimer())\n", 1),
    ("             mask=d_mask)\n",
     "             mask=d_mask)\n    tl.store(slot + 1, globaltimer())\n", 1),
]


def patched(module, edits, name: str):
    """`module`'s source with `edits` applied, loaded as its own module."""
    src = pathlib.Path(module.__file__).read_text()
    for old, new, count in edits:
        assert src.count(old) == count, f"{old!r} moved: update this probe"
        src = src.replace(old, new)
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    patched_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched_module)
    return patched_module


def calls(timeline: torch.Tensor, merge_timeline: torch.Tensor, pages: str, variant: str):
    """(decode, merge) launches of the stamped kernels, as launch_mla_decode_gluon and merge_splits_tiled do."""
    name = "colsplit_" + "".join(c if c.isalnum() else "_" for c in variant)
    decode_kernel = patched(colsplit, EDITS + VARIANTS[variant], name)._mla_decode_colsplit_kernel
    merge_kernel = patched(merge_tiled, MERGE_EDITS, "merge_stamped")._merge_tiled_kernel
    q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, po, pl = inputs(1, HEADS, SEQ, 1, SPLITS, torch.float16,
                                                                              pages)

    def decode():
        decode_kernel[(2, 1, SPLITS)](
            q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits, seq_lens, timeline,
            WIDTH ** -0.5 * LOG2E, q.stride(0), q.stride(1), kv.stride(0), out.stride(0), out.stride(1),
            *partial_strides(po, pl), NUM_HEADS=HEADS, LATENT=GLUON_LATENT, ROPE=GLUON_ROPE, PAGE_SIZE=1,
            WRITE_FINAL=False, TOKENS=1, num_warps=4, CONSUMER_REGS=COLSPLIT_REGS, SCALED=True)

    def merge():
        merge_kernel[(1, HEADS, triton.cdiv(512, merge_tiled.MERGE_COLUMNS))](
            out, po, pl, num_splits, 1.0, merge_timeline, out.stride(0), out.stride(1), po.stride(0), po.stride(1),
            po.stride(2), pl.stride(0), pl.stride(1), V_DIM=512, BLOCK_DV=merge_tiled.MERGE_COLUMNS,
            BLOCK_S=SPLITS, ONE_TILE=True, SCALED=True, num_warps=1)

    return decode, merge


def quartiles(xs) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"min": round(xs[0], 3), "p25": round(q[0], 3), "median": round(q[1], 3), "p75": round(q[2], 3),
            "max": round(xs[-1], 3)}


def summarise(tl_cpu: torch.Tensor, merge_cpu: torch.Tensor) -> dict:
    """Per-warpgroup phase durations in us and the CTAs' and merge programs' spans on the global timer, relative to
    the first CTA's start. The SM clock is each warpgroup's clock64 ticks over its global-timer nanoseconds."""
    st = tl_cpu.view(SPLITS * 2, 2, SLOTS).double()
    ghz = ((st[:, :, 24] - st[:, :, 0]).sum() / (st[:, :, 31] - st[:, :, 30]).sum()).item()
    us = lambda a, b: ((st[:, :, b] - st[:, :, a]) / (ghz * 1e3)).flatten().tolist()
    phases = {"start -> tile 0 landed": us(0, 1), "tile 0 (landed -> its PV done)": us(1, 2)}
    for t in range(1, 8):
        phases[f"tile {t}"] = us(1 + t, 2 + t)
    phases["last PV -> copies drained"] = us(9, 22)
    phases["-> epilogue handshake"] = us(22, 23)
    phases["-> stores issued"] = us(23, 24)
    phases["whole warpgroup (clock)"] = us(0, 24)
    prev = 18
    for slot, name in PHASES.items():
        if slot > 18:
            phases[f"tile {MID}: {name}"] = us(prev, slot)
            prev = slot
    phases[f"tile {MID}: -> PV done"] = us(21, 2 + MID)
    t0 = st[:, :, 30].min()
    g = lambda s: ((st[:, :, s] - t0) / 1e3).flatten().tolist()
    m = merge_cpu.view(-1, 2).double()
    span = {"decode start (global)": g(30), "decode end (global)": g(31),
            "merge start (global)": ((m[:, 0] - t0) / 1e3).tolist(),
            "merge end (global)": ((m[:, 1] - t0) / 1e3).tolist()}
    return {"phases_us": {k: quartiles(v) for k, v in phases.items()},
            "spans_us": {k: quartiles(v) for k, v in span.items()},
            "sms": len(set(st[:, :, 32].long().flatten().tolist())), "sm_ghz": round(ghz, 3)}


def compile_reports(variants: list[str]) -> dict:
    """{variant: compile_mla_sm90's report} of the stamped decode kernel as the race runs it (1-token pages,
    128 heads, float16 partials), compiled for sm_90 without a GPU."""
    from compile_mla_sm90 import compile_sm90  # a sibling script
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = {"NUM_HEADS": HEADS, "LATENT": GLUON_LATENT, "ROPE": GLUON_ROPE, "PAGE_SIZE": 1, "WRITE_FINAL": False,
                  "TOKENS": 1, "CONSUMER_REGS": COLSPLIT_REGS, "SCALED": True, "kv_desc": None}
    out = {}
    for variant in variants:
        name = "colsplit_" + "".join(c if c.isalnum() else "_" for c in variant)
        kernel = patched(colsplit, EDITS + VARIANTS[variant], name)._mla_decode_colsplit_kernel
        out[variant] = compile_sm90(kernel, constexprs, 4, 1, source=GluonASTSource,
                                    pointers={"PartialO": "*fp16", "group_ntok": "*i64"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--pages", nargs="+", default=["own"], help="own (scattered), hot (an L2-resident window)")
    p.add_argument("--compile-only", action="store_true", help="print the sm_90 compile reports as JSON and stop")
    p.add_argument("--json")
    args = p.parse_args()
    if args.compile_only:
        print(json.dumps(compile_reports(args.variants)))
        return 0
    report = {}
    for pages, variant in [(p, v) for v in args.variants for p in args.pages]:
        timeline = torch.zeros(SPLITS * 2 * 2 * SLOTS, device="cuda", dtype=torch.int64)
        merge_timeline = torch.zeros(HEADS * 8 * 2, device="cuda", dtype=torch.int64)
        decode, merge = calls(timeline, merge_timeline, pages, variant)

        def both(decode=decode, merge=merge):
            decode()
            merge()

        us = [round(time_call(both, use_graph=True)[0], 2) for _ in range(3)]
        key = f"{variant} / {pages}"
        report[key] = {"decode_plus_merge_us": us, **summarise(timeline.cpu(), merge_timeline.cpu())}
        print(key, us, flush=True)
        for name, q in {**report[key]["phases_us"], **report[key]["spans_us"]}.items():
            print(f"  {name:72s} {q['min']:7.3f} {q['median']:7.3f} {q['max']:7.3f}", flush=True)
    if args.json:
        write_json(args.json, [report])
    return 0


if __name__ == "__main__":
    sys.exit(main())
