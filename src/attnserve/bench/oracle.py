"""What a raced output is checked against, and how a time becomes a rate against the roofline.

The oracle is the float32 reference attention (`reference.attention`) over the race batch; it
builds dense scores, so past `ORACLE_MAX_SCORES` per request there is none and the caller checks
against a peer instead. `rel_err` is the one error measure both `bench kernels` and `tune` use.
"""

from __future__ import annotations

import torch

from attnserve.reference.attention import reference_for_batch

ORACLE_MAX_SCORES = 2**31  # float32 dense score elements the oracle may build per request


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def oracle_output(rb) -> torch.Tensor | None:
    """The reference output of race batch `rb`, or None where its dense scores would not fit."""
    w = rb.workload
    if w.new_tokens * w.seq_len * rb.layer.num_heads > ORACLE_MAX_SCORES:
        return None
    return reference_for_batch(rb.q, rb.layer, rb.fb, compute_dtype=torch.float32)


def rates(w, us: float, rb, ceilings: dict) -> dict:
    """Workload `w` run in `us` microseconds as TB/s (decode) or TFLOP/s, and its % of the ceiling that bounds it."""
    lay = rb.layer
    if w.mla is not None:  # decode reads the latent once and is compute-bound at 128 heads: both rates
        rec = {"tflops": round(w.mla_flops() / us / 1e6, 1)}
        if w.kind == "decode":
            rec["tbps"] = round(w.mla_bytes(rb.pool.dtype.itemsize) / us / 1e6, 3)
        if ceilings.get("matmul_tflops"):
            rec["pct_of_ceiling"] = round(100 * rec["tflops"] / ceilings["matmul_tflops"], 1)
        return rec
    if w.kind == "decode":
        tbps = w.kv_bytes(lay.num_kv_heads, lay.head_dim, rb.pool.dtype.itemsize) / us / 1e6
        rec = {"tbps": round(tbps, 3)}
        if ceilings.get("copy_tbps"):
            rec["pct_of_ceiling"] = round(100 * tbps / ceilings["copy_tbps"], 1)
        return rec
    tflops = w.flops(lay.num_heads, lay.head_dim) / us / 1e6
    rec = {"tflops": round(tflops, 1)}
    if ceilings.get("matmul_tflops"):
        rec["pct_of_ceiling"] = round(100 * tflops / ceilings["matmul_tflops"], 1)
    return rec
