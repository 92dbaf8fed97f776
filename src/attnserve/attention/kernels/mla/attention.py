"""Absorbed MLA decode, whichever kernel the plan names: stage 1 on Triton or Gluon, then the split merge.

A layer's KernelPlan (kernels/plan.py) names the kernel, its tile and its partials format, resolved once by the
backend; this module launches it and merges the splits a tile of splits x columns at a time (merge_tiled.py: one
long request cut into many splits is MLA's common case).

Float16 partials (`MLADecodeConfig.partials`, the scorer kernel's): one long request at 128 heads ends its wave
by writing 64 splits x 128 heads x 512 normalised partial columns that the merge reads back; float16 halves those
bytes. bfloat16 would carry 8 significant bits into the sum; float16 carries 11, three more than the bf16 output,
but not bf16's range, so each partial row is stored times a power of two 2^k that puts its largest value in
[2^14, 2^15), k in the row's column 512 (rows of 512 + 8 halves in the float32 buffers' bytes): every value
within 2^28 of its row's largest keeps the 11 bits, whatever the latent's magnitude.
"""

from __future__ import annotations

import torch

from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
from attnserve.attention.kernels.mla.decode import launch_triton_mla_decode
from attnserve.attention.kernels.mla.shapes import check_mla_shapes
from attnserve.attention.kernels.params import DecodeRows
from attnserve.attention.kernels.plan import KernelPlan
from attnserve.attention.kernels.split_kv import split_outputs


def mla_decode_attention(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    out: torch.Tensor,
    rows: DecodeRows,
    plan: KernelPlan,
    sm_scale: float,
    kv_scale: float = 1.0,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_final: bool | None = None,
) -> torch.Tensor:
    """One query token per request against its latent KV (absorbed MLA), on the plan's kernel.

    q `[B, H, kv_lora_rank + rope]` (q_nope folded through W_UK, then q_pe); kv_buffer
    `[slots, 1, kv_lora_rank + rope]` (the MLA pool's buffer, bf16/fp16/fp32 or FP8 e4m3 holding
    x / kv_scale); out `[B, H, kv_lora_rank]`. rows / write_final / partials as in mha.decode.decode_attention;
    rows.token_groups: extend rows' CTAs of several tokens (extend_rows.ExtendRowsPlan), the seesaw kernel's
    alone. The plan's kv_lora_rank and the rows' page size are the pool's.
    """
    kv_lora_rank = plan.signature.kv_lora_rank
    check_mla_shapes(q, kv_buffer, out, kv_lora_rank)
    if q.shape[1] != plan.signature.num_heads:  # the grid comes from the plan: other heads would go uncomputed
        raise ValueError(f"q has {q.shape[1]} heads, the plan was resolved for {plan.signature.num_heads}")
    if q.shape[0] == 0:
        return out
    token_groups, max_splits = rows.token_groups, rows.max_splits
    if token_groups is not None and token_groups[2] > 1 and plan.kernel != "gluon_seesaw":
        raise ValueError(f"CTAs of several query tokens need the gluon_seesaw MLA kernel, the plan's is {plan.kernel}")
    if write_final is None:
        write_final = max_splits == 1
    partial_o, partial_lse = split_outputs(out, partials, max_splits, write_final)
    if plan.is_gluon:
        from attnserve.attention.kernels.mla.gluon.launch import launch_gluon_mla_decode  # Gluon: Hopper only

        if plan.partials == "float16" and not write_final:  # the float32 rows' bytes, half of each used
            partial_o = partial_o.view(torch.float16)[..., : kv_lora_rank + 8]  # [B, H, S, 512 + 8]
        launch_gluon_mla_decode(q, kv_buffer, out, partial_o, partial_lse, rows, plan, sm_scale, write_final)
        kv_scale = 1.0  # the Gluon kernels take 16-bit latents alone
    else:
        launch_triton_mla_decode(q, kv_buffer, out, partial_o, partial_lse, rows, plan, sm_scale, kv_scale,
                                 write_final)
    if not write_final:
        merge_splits_tiled(out, partial_o, partial_lse, rows.num_splits, max_splits, kv_scale)
    return out


__all__ = ["mla_decode_attention"]
