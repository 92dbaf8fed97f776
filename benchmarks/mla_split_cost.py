"""What a split costs the Gluon seesaw MLA decode kernel apart from its tiles: one long request at 128 heads.

Timing only, CUDA graphs, no oracle (the kernel tests check results). At a fixed split count (so a fixed number
of CTAs, one wave) the context is set to `k` 64-key tiles per split for several k: the kernel's time is then
F + k t, F a CTA's cost apart from its tiles (launch, the query and first tiles' latency, the epilogue) and t a
tile. The same is timed with the partial stores left out (a runtime-false mask: the math still runs), with
bfloat16 partials, over 64-token pages, and the merge alone; `--variants` picks them.

    PYTHONPATH=src python3 benchmarks/mla_split_cost.py [--splits 64 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch

import attnserve.attention.kernels.mla_decode_gluon as gluon_host
from attnserve.attention.kernels.decode import partial_strides
from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
from attnserve.bench.timing import time_call

HEADS, WIDTH, LATENT = 128, 576, 512
SEESAW = pathlib.Path(gluon_host.__file__).with_name("mla_decode_seesaw.py")
PARTIAL_STORE = "o.to(PartialO.dtype.element_ty), mask=mask)"


def seesaw_without_partial_stores():
    """The seesaw kernel whose partial-output store is masked by a runtime-false condition (the softmax scale is
    the split stride is positive), so the compiler keeps the math that feeds it."""
    src = SEESAW.read_text()
    assert src.count(PARTIAL_STORE) == 1, "the partial store moved: update this harness"
    src = src.replace(PARTIAL_STORE, "o.to(PartialO.dtype.element_ty), mask=mask & (stride_ps < 0))")
    path = pathlib.Path(tempfile.mkdtemp()) / "seesaw_no_partial_store.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("seesaw_no_partial_store", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._mla_decode_seesaw_kernel


def inputs(seq: int, page: int, splits: int, partial_dtype: torch.dtype):
    pages = seq // page
    q = torch.randn(1, HEADS, WIDTH, device="cuda", dtype=torch.bfloat16)  # [1, H, 512 + 64]
    kv = torch.randn(pages * page, 1, WIDTH, device="cuda", dtype=torch.bfloat16)  # the latent pool
    kv_indices = torch.randperm(pages, device="cuda", dtype=torch.int32)  # scattered pages
    kv_indptr = torch.tensor([0, pages], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([seq], device="cuda", dtype=torch.int32)
    num_splits = torch.tensor([splits], device="cuda", dtype=torch.int32)
    out = torch.empty(1, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
    partial_o = torch.empty(1, HEADS, splits, LATENT, device="cuda", dtype=partial_dtype)  # [1, H, S, 512]
    partial_lse = torch.empty(1, HEADS, splits, device="cuda", dtype=torch.float32)
    return q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, partial_o, partial_lse


def time_variant(kernel, seq: int, page: int, splits: int, partial_dtype: torch.dtype, merge: bool) -> float:
    q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, po, pl = inputs(seq, page, splits, partial_dtype)
    strides = partial_strides(po, pl)

    def call():
        if kernel is not None:
            gluon_host.launch_mla_decode_gluon(q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits,
                                               splits, page, WIDTH ** -0.5, False, strides)
        if merge:
            merge_splits_tiled(out, po, pl, num_splits, splits, 1.0)

    original = gluon_host._mla_decode_seesaw_kernel
    gluon_host._mla_decode_seesaw_kernel = kernel or original
    try:
        return time_call(call, use_graph=True)[0]
    finally:
        gluon_host._mla_decode_seesaw_kernel = original


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", type=int, nargs="+", default=[64, 32])
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="64-key tiles per split")
    p.add_argument("--variants", nargs="+", default=["full", "no-partial-store", "bf16-partials", "page64", "merge",
                                                     "merge-bf16"])
    p.add_argument("--json")
    args = p.parse_args()
    kernels = {"full": gluon_host._mla_decode_seesaw_kernel}
    if "no-partial-store" in args.variants:
        kernels["no-partial-store"] = seesaw_without_partial_stores()
    plans = {  # variant: (kernel, page, partial dtype, merge)
        "full": (kernels["full"], 1, torch.float32, False),
        "no-partial-store": (kernels.get("no-partial-store"), 1, torch.float32, False),
        "bf16-partials": (kernels["full"], 1, torch.bfloat16, False),
        "page64": (kernels["full"], 64, torch.float32, False),
        "merge": (None, 1, torch.float32, True),
        "merge-bf16": (None, 1, torch.bfloat16, True),
        "full+merge": (kernels["full"], 1, torch.float32, True),
        "bf16+merge": (kernels["full"], 1, torch.bfloat16, True),
    }
    rows = []
    for splits in args.splits:
        for variant in args.variants:
            kernel, page, dtype, merge = plans[variant]
            for k in args.tiles:
                us = time_variant(kernel, splits * 64 * k, page, splits, dtype, merge)
                rows.append({"splits": splits, "tiles_per_split": k, "seq": splits * 64 * k, "variant": variant,
                             "us": round(us, 2)})
                print(json.dumps(rows[-1]), flush=True)
            fit = [r for r in rows if r["splits"] == splits and r["variant"] == variant]
            if len(fit) > 1:  # least squares us = F + k t
                n = len(fit)
                sk = sum(r["tiles_per_split"] for r in fit)
                su = sum(r["us"] for r in fit)
                skk = sum(r["tiles_per_split"] ** 2 for r in fit)
                sku = sum(r["tiles_per_split"] * r["us"] for r in fit)
                t = (n * sku - sk * su) / (n * skk - sk * sk)
                print(f"  {variant} at {splits} splits: F = {(su - t * sk) / n:.2f} us, t = {t:.3f} us a tile",
                      flush=True)
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
