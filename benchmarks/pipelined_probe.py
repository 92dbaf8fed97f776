"""Probe: the pipelined (32-key, 4-stage) column-split kernel against the shipped column-split one, same run."""
import json, sys
import torch
from attnserve.attention.kernels.decode import allocate_partials, partial_strides
from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
from attnserve.attention.kernels.mla_decode_colsplit import _mla_decode_colsplit_kernel
from attnserve.attention.kernels.mla_decode_pipelined import _mla_decode_pipelined_kernel
from attnserve.attention.kernels.mla_decode_gluon import COLSPLIT_REGS
from attnserve.bench.timing import time_call

H, W, L = 128, 576, 512
SCALE = W ** -0.5
torch.manual_seed(0)
KERNELS = {"colsplit": _mla_decode_colsplit_kernel, "pipelined": _mla_decode_pipelined_kernel}


def case(r, seq, S, page):
    q = torch.randn(r, H, W, device="cuda", dtype=torch.bfloat16)
    pages = r * seq // page
    kv = torch.randn(pages * page, 1, W, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(pages, device="cuda").to(torch.int32)
    kv_indptr = torch.arange(0, r + 1, device="cuda", dtype=torch.int32) * (seq // page)
    seq_lens = torch.full((r,), seq, device="cuda", dtype=torch.int32)
    num_splits = torch.full((r,), S, device="cuda", dtype=torch.int32)
    po, pl = allocate_partials(r, H, S, L, q.device)
    po = po.view(torch.float16)[..., : L + 8]
    out = torch.empty(r, H, L, device="cuda", dtype=torch.bfloat16)
    final = S == 1

    def f(name, merge=True):
        KERNELS[name][(2, r, S)](
            q, kv, out, po, pl, kv_indptr, perm, seq_lens, num_splits, seq_lens, seq_lens, SCALE * 1.4426950408889634,
            q.stride(0), q.stride(1), kv.stride(0), out.stride(0), out.stride(1), *partial_strides(po, pl),
            NUM_HEADS=H, LATENT=L, ROPE=64, PAGE_SIZE=page, WRITE_FINAL=final, TOKENS=1, num_warps=4,
            CONSUMER_REGS=COLSPLIT_REGS, SCALED=not final)
        if merge and not final:
            merge_splits_tiled(out, po, pl, num_splits, S, 1.0)

    def reference(i):
        rows = (perm[i * (seq // page):(i + 1) * (seq // page)].long()[:, None] * page
                + torch.arange(page, device="cuda")).reshape(-1)
        k = kv[rows, 0].float()  # [seq, 576]
        p = torch.softmax(q[i].float() @ k.T * SCALE, dim=-1)
        return p @ k[:, :L]
    return f, out, reference


for name, (r, seq, S, page) in {"1x32768 p1": (1, 32768, 64, 1), "1x4000 p1 ragged": (1, 4000, 64, 1),
                                "128x4096 p1": (128, 4096, 1, 1), "64x8192 p64 (2 splits)": (64, 8192, 2, 64),
                                "3x1000 p1, 5 splits": (3, 1000, 5, 1)}.items():
    f, out, reference = case(r, seq, S, page)
    for k in KERNELS:
        f(k); torch.cuda.synchronize()
        err = max(float((out[i].float() - reference(i)).abs().max()) for i in range(min(r, 3)))
        print(json.dumps({"case": name, "kernel": k, "max_abs_err_vs_fp32": err}), flush=True)
    if "ragged" in name or "3x" in name:
        continue
    for rep in range(2):
        for k in KERNELS:
            us = round(time_call(lambda: f(k), use_graph=True)[0], 2)
            alone = round(time_call(lambda: f(k, False), use_graph=True)[0], 2) if S > 1 else None
            print(json.dumps({"case": name, "kernel": k, "us": us, "kernel_alone_us": alone}), flush=True)
