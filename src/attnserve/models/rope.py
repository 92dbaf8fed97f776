"""Rotary position embedding with the HF scaling variants the supported configs use.

Frequencies are derived exactly as HF derives them (same float32 arithmetic), so
logits match a transformers run to rounding. cos/sin are computed per step from
the positions rather than from a cached table: it is cheap, exact for any
position, and has no length limit to overflow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.models.config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, ramp between; scale cos/sin."""
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings") or max_pos
    if factor is None:
        factor = max_pos / orig
    attn_factor = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if attn_factor is None:
        if mscale and mscale_all:
            attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attn_factor = yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequency, extrapolated as trained
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


def rope_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, cos/sin multiplier) for a rotary dimension `dim`."""
    rope.check_supported()
    p, kind = rope.params, rope.rope_type
    if kind == "yarn":
        return _yarn_inv_freq(rope.theta, dim, p, max_position_embeddings)
    inv_freq = _base_inv_freq(rope.theta, dim)
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, p)
    if p.get("freq_divisors") is not None:  # GGUF rope_freqs: per-frequency divisors (Llama 3.1 files)
        inv_freq = inv_freq / torch.tensor(p["freq_divisors"], dtype=torch.float32)
    # "dynamic" (NTK) equals default inside max_position_embeddings; RotaryEmbedding rescales past it
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q `[T, Hq, D]` and k `[T, Hk, D]` (first `rotary_dim` channels) at `positions` [T].

    interleaved=False: HF/NeoX layout, channel i pairs with i + D/2 (rotate_half).
    interleaved=True: DeepSeek layout, channel 2i pairs with 2i+1.
    """

    def __init__(self, rotary_dim: int, rope: RopeConfig, max_position_embeddings: int, interleaved: bool = False):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(rope, rotary_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [rotary_dim/2] float32
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.dynamic_factor = float(rope.params["factor"]) if rope.rope_type == "dynamic" else None
        self.theta = rope.theta
        self.max_position_embeddings = max_position_embeddings

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: past max_position_embeddings the base grows with the step's longest position.

        Computed on the device from the positions (no host sync, so it works inside CUDA graphs).
        Keys already cached keep the frequencies they were rotated with, as in HF's cached generation;
        requests batched together share the frequencies of the batch's longest one.
        """
        dim, factor, max_pos = self.rotary_dim, self.dynamic_factor, self.max_position_embeddings
        seq_len = (positions.max() + 1).float() if positions.numel() else positions.new_tensor(0.0).float()
        base = self.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        scaled = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim))
        return torch.where(seq_len > max_pos, scaled, self.inv_freq)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if self.dynamic_factor is None else self._dynamic_inv_freq(positions)
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = self.rotary_dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` from `cos_sin(positions, dtype)`, computed once per step and shared by every layer."""
        cos, sin = self.cos_sin(positions, q.dtype) if cos_sin is None else cos_sin
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def step(self, positions: torch.Tensor, dtype: torch.dtype, fused_store: Callable | None = None) -> RopeStep:
        """This step's RoPE for every layer: cos/sin computed once, and the fused rotate+store kernel if any."""
        cos, sin = self.cos_sin(positions, dtype)
        if self.interleaved or fused_store is not None:
            return RopeStep(self, cos, sin, fused_store)
        cos_full = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        sin_signed = torch.cat((-sin, sin), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        return RopeStep(self, cos, sin, fused_store, cos_full, sin_signed)


@dataclass(frozen=True)
class RopeStep:
    """One step's rotary embedding, handed to every attention layer.

    `rotate` is the unfused rotation. `fused_store` (ops' rope_store kernel, or None) rotates q/k and
    writes k/v into the pool in one pass; the attention backend decides whether it may
    (`AttentionBackend.rotate_and_store_kv`), since storing K/V is the backend's job.
    """

    rotary: RotaryEmbedding
    cos: torch.Tensor  # [T, rotary_dim/2]
    sin: torch.Tensor  # [T, rotary_dim/2]
    fused_store: Callable | None = None
    # half-split layout rotating whole heads: [T, 1, D] tables for the 4-op rotation (None otherwise)
    cos_full: torch.Tensor | None = None  # [cos, cos]
    sin_signed: torch.Tensor | None = None  # [-sin, sin]

    def narrow(self, tokens: int) -> RopeStep:
        """The step's first `tokens` tokens (a piecewise graph's padded step, run over its real tokens)."""
        def first(t):
            return None if t is None else t[:tokens]
        return dataclasses.replace(self, cos=self.cos[:tokens], sin=self.sin[:tokens], cos_full=first(self.cos_full),
                                   sin_signed=first(self.sin_signed))

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rotary.rotary_dim
        if self.cos_full is not None and q.shape[-1] == d and k.shape[-1] == d:
            return self._rotate_whole(q), self._rotate_whole(k)
        return self.rotary._rotate(q, self.cos, self.sin), self.rotary._rotate(k, self.cos, self.sin)

    def _rotate_whole(self, x: torch.Tensor) -> torch.Tensor:
        """x * [cos, cos] + [x2, x1] * [-sin, sin]: the same products and sums as `_rotate` (x1 cos - x2 sin
        is x1 cos + x2 (-sin) exactly), so the same bits, in 4 kernels instead of ~12; on the CPU each
        kernel launch costs more than its arithmetic at decode sizes."""
        t, h, d = x.shape
        swapped = x.reshape(t, h, 2, d // 2).flip(2).view(t, h, d)  # [T, H, D]: halves exchanged
        return x * self.cos_full + swapped * self.sin_signed

    def rotate_and_store(self, q, k, v, k_buffer, v_buffer, loc) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k/v `[T, Hk, D]` -> rotated (q, k); k/v written to the buffers at loc `[T]`."""
        if self.fused_store is None:
            raise ValueError("this step has no fused rotate+store kernel; rotate and store separately")
        return self.fused_store(q, k, v, self.cos, self.sin, k_buffer, v_buffer, loc, self.rotary.interleaved)
