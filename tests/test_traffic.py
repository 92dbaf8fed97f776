"""attention.traffic and `attnserve traffic`: the seed figures and the FlashAttention paper's Figure 2 setting
worked out by hand, exactly; block visiting under a causal mask; GQA; the roofline; the command's table,
--json and --png."""

from __future__ import annotations

import json

import pytest
import torch

from attnserve.analysis.traffic import (
    Tile,
    backward_bytes,
    forward_bytes,
    gpu_ceilings,
    paper_tile,
    traffic_report,
    visible_pairs,
)
from attnserve.cli import main
from attnserve.shape import AttentionShape

ONE_HEAD = AttentionShape(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=128, v_head_dim=128,
                          attention_type="MHA", name="one head")


def test_seed_figures_a_2000_token_prefill_of_one_head():
    # S is 2000 x 2000 bf16 = 8 MB, P again; naive moves S and P twice each (32 MB) beside Q, K, V, O (2 MB)
    r = traffic_report("one head", ONE_HEAD, 2000, 1, gpu_ceilings("h200"), causal=False)
    assert r.score_matrix_bytes_per_head == 8_000_000
    assert r.forward["naive"].bytes == 34_048_000
    assert r.forward["lower_bound"].bytes == 2_048_000
    assert r.forward["naive"].bytes - r.forward["lower_bound"].bytes == 4 * 8_000_000
    assert round(r.forward["naive"].bytes / 1e6) == 34 and round(r.forward["lower_bound"].bytes / 1e6) == 2


def test_the_flashattention_paper_figure_2_setting_by_hand():
    # GPT-2 medium attention (T = 1024, d = 64, 16 heads, batch 64: 1024 heads) on an A100, whose 192 KB of
    # on-chip memory per multiprocessor hold M = 98,304 fp16 elements. Algorithm 1: Bc = ceil(M / 4d) = 384,
    # Br = min(Bc, d) = 64, so Tc = ceil(1024 / 384) = 3 K/V blocks and every row block is visited 3 times.
    tile = paper_tile(192 * 1024, 64, 2)
    assert tile == Tile(br=64, bc=384)
    t, d, b = 1024, 64, 2
    fwd = forward_bytes(t, d, d, b, tile, causal=False)
    bwd = backward_bytes(t, d, d, b, tile, causal=False)
    # naive: b (4 T^2 + 4 T d) forward, b (7 T^2 + 8 T d) backward
    assert fwd["naive"] == 2 * (4 * 1024**2 + 4 * 1024 * 64) == 8_912_896
    assert bwd["naive"] == 2 * (7 * 1024**2 + 8 * 1024 * 64) == 15_728_640
    # flash forward: O initialised (T d b) and l, m (2 T * 4); K, V read once (2 T d b); 3 x 1024 visited rows,
    # each reading Q_i, O_i, l_i, m_i and writing O_i, l_i, m_i: 3072 * (b (d + 2d) + 4 * 4)
    assert fwd["flash"] == 131_072 + 8_192 + 262_144 + 3072 * (2 * 192 + 16) == 1_630_208
    # flash backward: dQ, dK, dV initialised (3 T d b); K, V read, dK, dV written (4 T d b); per visited row
    # Q, O, dO, dQ read, dQ written (5 d b) and l, m read (2 * 4)
    assert bwd["flash"] == 393_216 + 524_288 + 3072 * (2 * 320 + 8) == 2_908_160
    heads = 64 * 16
    assert (fwd["naive"] + bwd["naive"]) * heads == 25_232_932_864  # 25.2 GB (the paper measures 40.3 GB
    assert (fwd["flash"] + bwd["flash"]) * heads == 4_647_288_832  # with its mask and dropout passes; 4.4 GB)
    assert fwd["lower_bound"] == 4 * t * d * b


def test_flash_traffic_falls_as_on_chip_memory_grows():
    # Theorem 2: Theta(T^2 d^2 / M); four times the memory, a quarter of the per-pair traffic
    t, d = 8192, 64
    small = forward_bytes(t, d, d, 2, paper_tile(64 * 1024, d), causal=False)["flash"]
    big = forward_bytes(t, d, d, 2, paper_tile(256 * 1024, d), causal=False)["flash"]
    once = 2 * t * d + 2 * 4 * t + 2 * t * 2 * d  # the init and the single K, V read
    assert (small - once) == 4 * (big - once)


def test_causal_visits_only_blocks_with_a_visible_key():
    assert visible_pairs(4, True) == 10 and visible_pairs(4, False) == 16
    tile = Tile(br=2, bc=2)
    # 4 tokens, 2 x 2 blocks: causal visits (0, 0), (1, 0), (1, 1) — 3 pairs of 2 rows — against all 4 pairs
    full = forward_bytes(4, 8, 8, 2, tile, causal=False)["flash"]
    causal = forward_bytes(4, 8, 8, 2, tile, causal=True)["flash"]
    per_row = 2 * (8 + 16) + 16
    assert full - causal == 2 * per_row
    # query blocks outer (attnserve's order): Q and O once, the LSE once, a K/V block per visited pair
    rows = forward_bytes(4, 8, 8, 2, tile, causal=True, order="rows")["flash"]
    assert rows == 2 * 4 * 16 + 4 * 4 + (2 + 2 + 2) * 2 * 16


def test_gqa_lower_bound_reads_k_and_v_once_per_kv_head():
    mha = forward_bytes(1000, 128, 128, 2, Tile(128, 64), True, hq=32, hkv=32)
    gqa = forward_bytes(1000, 128, 128, 2, Tile(128, 64), True, hq=32, hkv=8)
    assert mha["lower_bound"] - gqa["lower_bound"] == 24 * 1000 * 256 * 2
    assert mha["naive"] == gqa["naive"] and mha["flash"] == gqa["flash"]


def test_roofline_places_each_form():
    gpu = gpu_ceilings("h200")
    shape = AttentionShape(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128,
                           attention_type="GQA")
    r = traffic_report("llama", shape, 8192, 1, gpu)
    assert r.forward["naive"].bound == "memory" and r.forward["lower_bound"].bound == "compute"
    for form in r.forward.values():
        assert form.attainable_tflops == pytest.approx(min(gpu.peak_tflops, form.intensity * gpu.hbm_tb_s))
        assert form.flops == 2 * 256 * 32 * 8192 * 8193 // 2
    assert r.forward["naive"].bytes > r.forward["flash"].bytes > r.forward["lower_bound"].bytes
    assert r.backward["naive"].bytes > r.backward["flash"].bytes > r.backward["lower_bound"].bytes
    assert (r.tile_br, r.tile_bc) == (128, 228)  # 228 KiB of shared memory: M = 116,736 bf16 elements


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_for_llama_3_8b_at_8k(capsys):
    d = _json(capsys, ["traffic", "--model", "llama-3-8b", "--seq-len", "8192", "--gpu", "h200", "--json"])
    assert (d["num_q_heads"], d["num_kv_heads"], d["head_dim"], d["num_layers"]) == (32, 8, 128, 32)
    assert d["score_matrix_bytes_per_head"] == 8192 * 8192 * 2
    assert d["forward"]["naive"]["bytes"] == 32 * 2 * (4 * 8192**2 + 4 * 8192 * 128)
    assert d["forward"]["lower_bound"]["bytes"] == 2 * 8192 * (32 * 256 + 8 * 256)
    assert set(d["backward"]) == {"naive", "flash", "lower_bound"}


def test_cli_table_tile_and_png(capsys, tmp_path):
    png = tmp_path / "traffic.png"
    assert main(["traffic", "--model", "llama-3-8b", "--seq-len", "4096", "--batch", "2", "--gpu", "h100",
                 "--tile", "128x64", "--order", "rows", "--no-causal", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "flash 128x64" in out and "lower bound" in out and "NVIDIA H100" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--tile", "128"], "--tile"),
    (["--gpu", "tpu"], "no roofline figures"),
    (["--seq-len", "0"], "seq_len"),
])
def test_cli_errors(capsys, argv, message):
    base = {"--model": "llama-3-8b", "--seq-len": "1024", "--gpu": "h200"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert main(["traffic", *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is present")
def test_cli_without_gpu_asks_for_one(capsys):
    assert main(["traffic", "--model", "llama-3-8b", "--seq-len", "1024"]) == 2
    assert "--gpu" in capsys.readouterr().err
