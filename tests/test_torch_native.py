"""torch_native against the float64 oracle on randomized ragged paged batches."""

import random
import zlib

import pytest
import torch

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.batch import ForwardMode
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch


def _run(sb):
    backend = TorchNativeBackend(sb.pool)
    meta = backend.plan(sb.fb)
    out = torch.full((sb.q.shape[0], sb.q.shape[1], sb.layer.v_head_dim), float("nan"), dtype=sb.q.dtype)
    out[:] = backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    return out


def _rel_err(out, ref):
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or masked-out rows)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def _ragged(rng, bs, max_prefix, max_ext, decode):
    prefix = [rng.randint(0 if not decode else 1, max_prefix) for _ in range(bs)]
    ext = [1] * bs if decode else [rng.randint(1, max_ext) for _ in range(bs)]
    return prefix, ext


CASES = [
    # page_size, heads_q, heads_kv, head_dim, decode
    (1, 4, 4, 64, False),
    (1, 8, 2, 128, True),
    (4, 8, 1, 64, False),
    (4, 16, 2, 64, True),
    (16, 8, 8, 128, False),
    (16, 8, 1, 64, True),
]


FEATURES = ["plain", "window", "sinks", "softcap", "custom_mask"]


# custom masks belong to extend/verify steps, so they pair with the extend cases only
@pytest.mark.parametrize(
    "page_size,hq,hkv,dim,decode,feature",
    [c + (f,) for c in CASES for f in FEATURES if not (c[-1] and f == "custom_mask")],
)
def test_matches_oracle(page_size, hq, hkv, dim, decode, feature):
    rng = random.Random(zlib.crc32(f"{page_size}-{hq}-{hkv}-{dim}-{decode}-{feature}".encode()))
    prefix, ext = _ragged(rng, rng.randint(1, 5), 40, 19, decode)
    kw = {
        "plain": {},
        "window": {"sliding_window": rng.randint(1, 12)},
        "sinks": {"use_sinks": True},
        "softcap": {"logit_cap": 5.0},
        "custom_mask": {"custom_mask": True},
    }[feature]
    mode = ForwardMode.DECODE if decode else ForwardMode.TARGET_VERIFY if feature == "custom_mask" else ForwardMode.EXTEND
    sb = make_batch(prefix, ext, hq, hkv, dim, page_size=page_size, score_scale=20, seed=rng.randint(0, 99),
                    mode=mode, **kw)
    # forward() dispatches on the mode: decode rows must reach forward_decode, the rest forward_extend
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert _rel_err(_run(sb), ref) < 1e-5


def test_prefix_free_prompt_uses_causal_rule():
    sb = make_batch([0, 0], [33, 7], 4, 2, 64, page_size=16, score_scale=20)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert _rel_err(_run(sb), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    sb = make_batch([5, 20, 0], [3, 1, 9], 8, 2, 64, page_size=4, dtype=dtype, seed=3)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert _run(sb).dtype == dtype
    assert _rel_err(_run(sb), ref) < 1e-2


@pytest.mark.parametrize("decode", [False, True])
def test_fp8_kv_dequantised_with_layer_scales(decode):
    prefix, ext = ([7, 30], [1, 1]) if decode else ([7, 30], [5, 2])
    sb = make_batch(prefix, ext, 8, 2, 64, page_size=4, kv_dtype="fp8_e4m3", seed=5)
    assert sb.pool.k_scale[0] != 1.0
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)  # reads the same quantised pool
    assert _rel_err(_run(sb), ref) < 1e-5


@pytest.mark.parametrize("decode", [False, True])
def test_mla_absorbed_latent(decode):
    prefix, ext = ([12, 3, 40], [1, 1, 1]) if decode else ([12, 0, 40], [4, 9, 2])
    sb = make_batch(prefix, ext, num_heads=16, mla=(64, 16), page_size=4, score_scale=20, seed=11)
    assert sb.layer.v_head_dim == 64 and sb.layer.head_dim == 80
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    out = _run(sb)
    assert out.shape == (sb.q.shape[0], 16, 64)
    assert _rel_err(out, ref) < 1e-5


def test_mixed_batch_with_decode_rows():
    sb = make_batch([10, 0, 25], [1, 12, 1], 8, 2, 64, page_size=4, mode=ForwardMode.MIXED, seed=2)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert _rel_err(_run(sb), ref) < 1e-5


def test_idle_step_returns_empty():
    sb = make_batch([4], [1], 4, 2, 64)
    backend = TorchNativeBackend(sb.pool)
    sb.fb.mode = ForwardMode.IDLE
    meta = backend.plan(sb.fb)
    out = backend.forward(sb.q[:0], None, None, sb.layer, sb.fb, meta)
    assert out.shape == (0, 4, 64)
