"""The skinny GEMM candidate (ops/kernels/skinny_gemm.py) against torch's F.linear, under the interpreter on a
CPU and compiled on a GPU: rows from 1 to 64, columns and K that do not fill a tile, K split or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnserve.ops.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, default_config, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)  # [N, K]
    return x, w


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("split", [1, 3])
def test_matches_f_linear(m, split):
    # N and K off the tile sizes: masked columns and a ragged last K step; split 3 of K = 200 in steps of 32
    x, w = _operands(m, 72, 200, torch.float32)
    y = skinny_linear(x, w, SkinnyConfig(block_n=32, block_k=32, split_k=split))
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_bf16_rounds_once_from_a_float32_sum():
    x, w = _operands(4, 64, 256, torch.bfloat16, seed=1)
    y = skinny_linear(x, w, SkinnyConfig(block_n=32, block_k=64, split_k=2))
    want = (x.float() @ w.float().T).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_the_default_config_splits_k_only_where_the_columns_cannot_fill_the_gpu():
    wide = default_config(1, 28672, 4096, programs_wanted=264)  # Llama-3-8B gate|up: 448 column tiles
    narrow = default_config(1, 4096, 14336, programs_wanted=264)  # down: 64 column tiles, a long K
    assert wide.split_k == 1
    assert narrow.split_k > 1 and 14336 // (narrow.block_k * narrow.split_k) >= 4


def test_refuses_what_it_is_not_for():
    x, w = _operands(MAX_ROWS + 1, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        skinny_linear(x[:4], w[:, :32].contiguous().T)
