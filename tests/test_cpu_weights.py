"""CPU weight formats: GGUF Q4 blocks read as codes, the int4 matmul, the CPU op set's RMSNorm bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from attnserve.models.cpu_weights import INT4_MAX_ROWS, CPUMatmul, pack_int4, prepack_dense
from attnserve.models.dequant import dequantize
from attnserve.models.q4_blocks import read_q4
from attnserve.ops import cpu, reference


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4_codes_decode_to_the_gguf_packages_floats(type_name):
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    raw = quantize(dense, GGMLQuantizationType[type_name])  # [48, blocks * bytes] uint8
    codes = read_q4(raw, type_name, (48, 96))
    assert codes.codes.shape == (48, 96) and int(codes.codes.max()) <= 15
    expected = dequantize(raw, type_name, (48, 96), torch.float32, "test")
    assert torch.equal(codes.dequantize(), expected)  # the same weights, bit for bit


@pytest.mark.needs_embedded_model
def test_q4_codes_of_the_embedded_model_match_its_dense_load():
    from attnserve.models.gguf_loader import GGUFFile
    from attnserve.models.loader import embedded_model_path

    gf = GGUFFile(embedded_model_path())
    tensors = [t for t in gf.tensor_list if t.type_name == "Q4_1"][:3]
    assert tensors
    for t in tensors:
        assert torch.equal(read_q4(t.data, t.type_name, t.shape).dequantize(),
                           dequantize(t.data, t.type_name, t.shape, torch.float32, t.name))


def _codes(n=160, k=192, seed=0):
    from attnserve.models.q4_blocks import Q4Codes

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    zero = torch.randn(n, k // 32, generator=g) * 0.01
    return Q4Codes(codes, scale, zero)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int4_matmul_matches_the_dequantized_weight(rows):
    """Tolerance 1e-2 relative: activations, scales and zeros go through bf16 (8 significant bits, 0.4% per
    rounding); a wrong nibble order, group or zero convention gives errors of order 1."""
    codes = _codes()
    x = torch.randn(rows, 192)
    ref = x @ codes.dequantize().t()  # fp32 [rows, 160]
    mm = CPUMatmul(None, pack_int4(codes), INT4_MAX_ROWS, torch.float32)
    out = mm(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-2


def test_rows_choose_int4_or_the_prepacked_dense_weight():
    codes = _codes()
    w = codes.dequantize().to(torch.bfloat16)
    dense = prepack_dense(w)
    mm = CPUMatmul(dense, pack_int4(codes), INT4_MAX_ROWS, torch.bfloat16)
    calls = []
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 192, dtype=torch.bfloat16)
        before = len(calls)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                       lambda *a: (calls.append(1), real(*a))[1], raising=False)
            y = mm(x)
        assert (len(calls) > before) == (rows <= INT4_MAX_ROWS)
        ref = x.float() @ w.float().t()
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2


def _assert_reference_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: the same bits. bf16: the reference's rounding points, so the same bits but where the
    normalised value sits on a rounding boundary (the statistics are summed in another order): there at
    most one bf16 ulp apart (2^-7 relative), in under 1% of the elements; an exact zero may come out
    as ~1e-9 (the mean of [x, -x] summed in another order is not exactly 0), hence the 1e-6 floor."""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
        return
    diff = (got.float() - want.float()).abs()
    floor = 1e-6 * float(want.float().abs().max())
    assert float((diff / (want.float().abs() * 2**-7 + floor)).max()) <= 1.0
    assert int((diff > 0).sum()) <= max(1, want.numel() // 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 64)])
def test_cpu_rmsnorm_has_the_references_bits(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    _assert_reference_bits(cpu.rmsnorm(x, w, 1e-5), reference.rmsnorm(x, w, 1e-5))
    got, summed = cpu.add_rmsnorm(x, res, w, 1e-5)
    want, want_summed = reference.add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)
    _assert_reference_bits(got, want)
