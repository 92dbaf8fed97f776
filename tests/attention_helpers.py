"""Checks shared by the backend and kernel tests."""

import torch

from attnserve.attention.layer import attention_step


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def poison_unused_slots(sb) -> None:
    """NaN every pool slot no request owns, so a read outside a request's KV shows in the output."""
    fb = sb.fb
    used = torch.zeros(sb.pool.num_slots, dtype=torch.bool, device=sb.pool.device)
    for row, seq in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu):
        used[fb.req_to_token[row, :seq].long()] = True
    for buf in (sb.pool.k_buffer[0], sb.pool.v_buffer[0]):
        if sb.pool.is_fp8:
            buf.view(torch.uint8)[~used] = 0x7F  # NaN in both FP8 formats
        else:
            buf[~used] = float("nan")


def run_layer_step(sb, backend):
    """One step the way a model runs it: plan, then the layer stores K/V (MLA: the latent) and calls the backend.
    The output `[T, Hq, Dv]` and what plan() returned (which kernels ran, e.g. its `extend_path`)."""
    fb = sb.fb
    meta = backend.plan(fb)
    with attention_step(backend, meta):
        out = sb.layer(sb.q, sb.k, sb.v, fb)  # [T, Hq * Dv]
    return out.view(sb.q.shape[0], sb.layer.num_heads, sb.layer.v_head_dim), meta


def run_layer(sb, backend) -> torch.Tensor:
    """run_layer_step's output alone."""
    return run_layer_step(sb, backend)[0]
