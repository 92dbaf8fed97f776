"""Resolving a KernelPlan (plan.py) per backend and layer signature, and naming it without a GPU.

`plan_mla_decode` and `plan_mha_decode` resolve a signature once, from the shipped tables
(mla/decode_table.json, mha/configs.py) and the kernels' fallbacks: a Gluon kernel that
cannot take the signature (an FP8 latent, a GPU other than Hopper, a latent other than 512 + 64) gives way to the
Triton kernel on the same tile with float32 partials, and a Triton tile drops pipeline stages until it fits the
GPU's shared memory. The backend keeps the plan and hands it to every launch; nothing is decided again per call.

`describe_kernels` names the kernels a backend would run for a model shape on a machine, without a GPU or
triton: `attnserve select` and the engine's start-up log print it beside the chosen backend.

Plain Python and torch: importable where triton is not installed.
"""

from __future__ import annotations

import dataclasses

import torch

from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, fewest_stages_dropped, target_for
from attnserve.attention.kernels.mha.configs import DecodeConfig, default_decode_config, fast_path_blocker
from attnserve.attention.kernels.mla.decode_table import (
    GLUON_BLOCK_H,
    GLUON_LATENT,
    GLUON_ROPE,
    GLUON_ROWS_CONFIG,
    INTERPRETER_MLA_DECODE_TILES,
    MLADecodeConfig,
    mla_tile_shape,
    tiles_for,
    tokens_per_cta,
)
from attnserve.attention.kernels.plan import INTERPRETER, KernelPlan, LayerSignature
from attnserve.attention.kernels.split_plan import SplitPolicy
from attnserve.dtypes import KV_DTYPES


# ---- MLA decode ------------------------------------------------------------------------------------------
def gluon_blocker(sig: LayerSignature) -> str | None:
    """Why the Gluon MLA kernels cannot take this signature (None: they can)."""
    if sig.arch == INTERPRETER:
        return "the Gluon MLA kernels need a CUDA device (Gluon has no interpreter)"
    if not sig.arch.startswith("sm9"):
        return "the Gluon MLA kernels are written for Hopper (sm90) wgmma"
    if sig.q_dtype not in (torch.bfloat16, torch.float16) or sig.kv_dtype != sig.q_dtype:
        return (f"the Gluon MLA kernels take a bf16/fp16 query and latent of one dtype, got {sig.q_dtype} / "
                f"{sig.kv_dtype}")
    if sig.kv_lora_rank != GLUON_LATENT or sig.head_dim != GLUON_LATENT + GLUON_ROPE:
        return (f"the Gluon MLA kernels are built for a {GLUON_LATENT}+{GLUON_ROPE} latent, got {sig.kv_lora_rank}+"
                f"{sig.head_dim - sig.kv_lora_rank}")
    return None


def default_mla_decode_config(sig: LayerSignature) -> MLADecodeConfig:
    """The table's tile for the signature's arch, heads and page size; the interpreter's small one on a CPU."""
    if sig.arch == INTERPRETER:
        return INTERPRETER_MLA_DECODE_TILES.for_heads(sig.num_heads)
    return tiles_for(sig.target.arch if sig.target else sig.arch, sig.num_heads, sig.page_size)


def mla_programs_per_split(num_heads: int, config: MLADecodeConfig) -> int:
    """Programs per (request, split): the head groups, what the split plan counts as KV heads for MLA."""
    return -(-num_heads // config.block_h)


def plan_mla_decode(sig: LayerSignature, policy: SplitPolicy, config: MLADecodeConfig | None = None,
                    waves_given: bool = False) -> KernelPlan:
    """The MLA decode kernel for this signature: `config` when given (a Gluon one raises where it cannot run),
    else the table's, as the signature can run it."""
    if config is not None:
        if config.kernel != "triton" and (why := gluon_blocker(sig)):
            raise ValueError(why)
        reason = "the tile given"
    else:
        config = default_mla_decode_config(sig)
        reason = "the interpreter's tile" if sig.arch == INTERPRETER else "the decode table's rule"
        if config.kernel != "triton" and (why := gluon_blocker(sig)):
            # float16 rows are the Gluon kernels' alone
            config = dataclasses.replace(config, kernel="triton", partials="float32")
            reason = f"the table's {config.block_h}-head tile in Triton: {why}"
        if config.kernel == "triton":
            config = fewest_stages_dropped(
                config, lambda c: mla_tile_shape(c, sig.head_dim, sig.kv_lora_rank, sig.q_dtype.itemsize), sig.target)
    if config.split_waves and not waves_given:
        policy = dataclasses.replace(policy, waves=config.split_waves)
    return KernelPlan(sig, config.kernel, config, policy, mla_programs_per_split(sig.num_heads, config),
                      config.partials, reason)


def plan_mla_extend_rows(sig: LayerSignature, policy: SplitPolicy, decode: KernelPlan, mode: bool | None,
                         extend_config_given: bool, waves_given: bool = False) -> tuple[KernelPlan | None, int, str | None]:
    """(plan, tokens a CTA, None) when MLA extend runs as decode rows, else (None, 1, why not).

    mode: None (by default wherever the Gluon kernel runs and no extend tile is given), False (never), True
    (always: the Gluon kernel where it runs, else the decode plan's tile, a token a CTA). policy: the backend's
    split policy, its waves replaced by the Gluon tile's unless given. Per-step reasons (a custom mask, too many
    tokens) are the backend's.
    """
    blocker = gluon_blocker(sig)
    if mode is False:
        return None, 1, "decode rows off"
    if mode is None and extend_config_given:
        return None, 1, "an extend tile was given"
    if mode is None and blocker:
        return None, 1, blocker
    if blocker is None:
        tokens = tokens_per_cta(sig.num_heads)
        cfg = GLUON_ROWS_CONFIG
        if not waves_given:
            policy = dataclasses.replace(policy, waves=cfg.split_waves)
        programs = -(-sig.num_heads * tokens // GLUON_BLOCK_H)
        plan = KernelPlan(sig, cfg.kernel, cfg, policy, programs, cfg.partials,
                          f"extend as decode rows, {tokens} token{'s' * (tokens > 1)} a CTA")
        return plan, tokens, None
    return dataclasses.replace(decode, reason=f"extend as decode rows on the decode tile ({blocker})"), 1, None


# ---- MHA decode ------------------------------------------------------------------------------------------
def mha_decode_tile_shape(sig: LayerSignature, c: DecodeConfig) -> TileShape:
    group = sig.num_heads // sig.num_kv_heads
    pow2 = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    return TileShape(max(16, pow2(group)), pow2(sig.head_dim), c.block_n, pow2(sig.head_dim) + pow2(sig.v_head_dim),
                     c.num_stages, sig.q_dtype.itemsize)


def plan_mha_decode(sig: LayerSignature, policy: SplitPolicy, config: DecodeConfig | None = None) -> KernelPlan:
    """Flash-Decoding over KV heads: the architecture's tile (stages dropped until it fits), or `config`."""
    reason = "the tile given"
    if config is None:
        config = fewest_stages_dropped(default_decode_config(sig.head_dim, sig.page_size, sig.target),
                                       lambda c: mha_decode_tile_shape(sig, c), sig.target)
        reason = "the architecture's tile"
    return KernelPlan(sig, "triton", config, policy, sig.num_kv_heads, "float32", reason)


# ---- description without a GPU ---------------------------------------------------------------------------
def signature_for(hw, shape, page_size: int, kv_dtype: str) -> LayerSignature:
    """A layer signature from a selection's inputs (attnserve.hardware.Hardware, attnserve.shape.AttentionShape,
    the KV cache dtype's name): queries run in bf16 on a GPU and float32 on a CPU."""
    target = None
    if hw.device == "cuda" and hw.compute_capability is not None:
        target = GpuTarget.of(hw.compute_capability)
    q_dtype = torch.bfloat16 if target is not None else torch.float32
    kv = KV_DTYPES.get(kv_dtype, q_dtype) if kv_dtype != "auto" else q_dtype
    if shape.attention_type == "MLA":
        rank = shape.kv_lora_rank or 0
        return LayerSignature.of_gpu(target, family="mla", num_heads=shape.num_q_heads, num_kv_heads=1,
                                     head_dim=rank + (shape.qk_rope_head_dim or 0), v_head_dim=rank,
                                     page_size=page_size, q_dtype=q_dtype, kv_dtype=kv, kv_lora_rank=rank)
    return LayerSignature.of_gpu(target, family="mha", num_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                                 head_dim=shape.head_dim, v_head_dim=shape.v_head_dim, page_size=page_size,
                                 q_dtype=q_dtype, kv_dtype=kv)


def describe_kernels(backend: str, side: str, hw, shape, page_size: int, kv_dtype: str) -> str | None:
    """`triton -> gluon scorer (sm90, 128 heads, page 64)`: the kernel `backend` runs for `side` ("prefill" or
    "decode"), from the selection's inputs alone; None for a backend whose kernels are not attnserve's."""
    if backend == "torch_native":
        return "torch_native -> torch"
    if backend != "triton":
        return None
    sig = signature_for(hw, shape, page_size, kv_dtype)
    if sig.arch == INTERPRETER:
        return f"triton -> {INTERPRETER}"
    policy = SplitPolicy(num_sms=hw.num_sms or 132)
    if sig.family == "mla":
        decode = plan_mla_decode(sig, policy)
        if side == "decode":
            return f"triton -> {decode.describe()}"
        rows, _, why = plan_mla_extend_rows(sig, policy, decode, None, False)
        if rows is not None:
            return f"triton -> {rows.describe()} ({rows.reason}); fresh prompts expanded"
        return f"triton -> triton mla extend ({sig.where()}; not decode rows: {why}); fresh prompts expanded"
    if side == "decode":
        return f"triton -> {plan_mha_decode(sig, policy).describe()}"
    why = fast_path_blocker(head_dim=sig.head_dim, v_dim=sig.v_head_dim, q_dtype=sig.q_dtype, kv_dtype=sig.kv_dtype,
                            custom_mask=None, target=sig.target, interpreting=False)
    if why is None:
        return f"triton -> prefill_tma ({sig.where()})"
    return f"triton -> paged extend ({sig.where()}; not prefill_tma: {why})"


def plan_for_call(q: torch.Tensor, kv_buffer: torch.Tensor, kv_lora_rank: int, page_size: int,
                  config: MLADecodeConfig | None = None, target: GpuTarget | None = None) -> KernelPlan:
    """The plan of a standalone call (tests, kernel benches): the layer signature read off its tensors."""
    target = target or target_for(q.device)
    sig = LayerSignature.of_gpu(target, family="mla", num_heads=q.shape[1], num_kv_heads=1, head_dim=q.shape[-1],
                                v_head_dim=kv_lora_rank, page_size=page_size, q_dtype=q.dtype,
                                kv_dtype=kv_buffer.dtype, kv_lora_rank=kv_lora_rank)
    return plan_mla_decode(sig, SplitPolicy(), config)


__all__ = ["default_mla_decode_config", "describe_kernels", "gluon_blocker", "plan_for_call", "plan_mha_decode",
           "plan_mla_decode", "plan_mla_extend_rows", "signature_for"]
