"""The Triton MLA decode tile table: rules per arch, head count and page size, kept equal to the sweep it
came from, and rewritten from a new sweep without hand-copying (all on the CPU)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, check_shared_memory
from attnserve.attention.kernels.mla import decode_table as tiles
from attnserve.attention.kernels.mla.decode_table import (
    MLADecodeConfig,
    rules_from_sweep,
    tiles_for,
    write_rules,
)
from attnserve.attention.kernels.plan import LayerSignature
from attnserve.attention.kernels.resolve import default_mla_decode_config, plan_mla_decode
from attnserve.attention.kernels.split_plan import SplitPolicy
from attnserve.bench.workloads import MLA_WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(tiles.__file__).with_name(tiles.TABLE_FILE)
SHAPES = {w.name: (w.mla.num_heads, w.page_size) for w in MLA_WORKLOADS if w.kind == "decode"}


def sig(target, heads, page_size, kv_dtype=torch.bfloat16):
    return LayerSignature.of_gpu(target, family="mla", num_heads=heads, num_kv_heads=1, head_dim=576, v_head_dim=512,
                                 page_size=page_size, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, kv_lora_rank=512)


def test_h200_tiles_follow_the_shape():
    """What the shipped sm90 rules say: 128 heads on the scorer Gluon kernel with float16 partials, at one wave
    of splits over single tokens and at half a wave over 64-token pages (its tiles there by TMA), 16 heads on the
    narrow Gluon kernel at half a wave (one split a request over many requests)."""
    h200 = GpuTarget.of((9, 0))
    scorer = MLADecodeConfig(64, 64, 8, 2, split_waves=1, kernel="gluon_scorer", partials="float16")
    assert default_mla_decode_config(sig(h200, 128, 1)) == scorer
    assert default_mla_decode_config(sig(h200, 128, 64)) == dataclasses.replace(scorer, split_waves=0.5)
    narrow = MLADecodeConfig(16, 64, 8, 2, split_waves=0.5, kernel="gluon_narrow")
    assert default_mla_decode_config(sig(h200, 16, 64)) == narrow
    assert tiles_for("sm75", 128, 64) == tiles_for("default", 128, 64)  # an unknown arch takes the default rules
    assert default_mla_decode_config(sig(None, 128, 64)).block_n == 16  # the interpreter's small tiles


@pytest.mark.parametrize("arch", sorted(tiles.shipped_rules()))
def test_every_shipped_tile_fits_its_architecture(arch):
    target = GpuTarget.of({"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0)}.get(arch, (7, 5)))
    for rule in tiles.shipped_rules()[arch]:
        c = rule.config
        kv_cols = 576 + 512 * c.defer_pv  # a deferred PV buffers the previous tile's latent too
        check_shared_memory("MLA decode", TileShape(c.block_h, 576, c.block_n, kv_cols, c.num_stages, 2), target)


def test_a_head_group_never_exceeds_the_heads():
    assert MLADecodeConfig(64, 32, 8, 2).for_heads(16) == MLADecodeConfig(16, 32, 4, 2)
    assert MLADecodeConfig(128, 16, 16, 2).for_heads(40) == MLADecodeConfig(64, 16, 8, 2)
    assert MLADecodeConfig(64, 32, 8, 2).for_heads(128) == MLADecodeConfig(64, 32, 8, 2)
    with pytest.raises(ValueError, match="block_h must be a power of two >= 16, got 24"):
        MLADecodeConfig(block_h=24)
    with pytest.raises(ValueError, match="num_warps .* got 3"):
        MLADecodeConfig(num_warps=3)


def test_float16_partials_are_the_scorer_kernels_alone():
    """The scaled float16 partials are written by the scorer kernel's epilogue only: another kernel asked for
    them, an unknown partial type, or a kernel that left the product, is refused at the config, not at launch."""
    assert MLADecodeConfig(64, 64, 8, 2, kernel="gluon_scorer", partials="float16").partials == "float16"
    with pytest.raises(ValueError, match="float16 partials are the gluon_scorer MLA kernels', "
                                         "the tile is gluon_seesaw's"):
        MLADecodeConfig(64, 64, 8, 2, kernel="gluon_seesaw", partials="float16")
    with pytest.raises(ValueError, match="partials must be 'float32' or 'float16', got 'bfloat16'"):
        MLADecodeConfig(64, 64, 8, 2, kernel="gluon_scorer", partials="bfloat16")
    with pytest.raises(ValueError, match="kernel must be one of"):
        MLADecodeConfig(64, 64, 8, 2, kernel="gluon_colsplit")


@pytest.mark.parametrize("page_size", [1, 64])
def test_a_gluon_tile_that_cannot_take_the_call_runs_in_triton_with_float32_partials(page_size):
    """The sm90 128-head tiles are the scorer kernel's with float16 partials; where it cannot run (an FP8 latent)
    the plan puts the same tile on the Triton kernel, which writes float32 ones (a config keeping float16 fails
    the FP8 decode at 128 heads over 64-token pages), and says why."""
    h200 = GpuTarget.of((9, 0))
    plan = plan_mla_decode(sig(h200, 128, page_size, kv_dtype=torch.float8_e4m3fn), SplitPolicy())
    assert (plan.kernel, plan.partials, plan.config.block_h) == ("triton", "float32", 64)
    assert "bf16/fp16 query and latent of one dtype" in plan.reason
    assert plan.programs_per_split == 2 and plan.split_policy.waves == (0.5 if page_size == 64 else 1)
    scorer = plan_mla_decode(sig(h200, 128, page_size), SplitPolicy())
    assert (scorer.kernel, scorer.partials) == ("gluon_scorer", "float16")
    assert scorer.describe() == f"gluon scorer (sm90, 128 heads, page {page_size})"
    with pytest.raises(ValueError, match="bf16/fp16"):  # a Gluon tile asked for where it cannot run says why
        plan_mla_decode(sig(h200, 128, page_size, kv_dtype=torch.float8_e4m3fn), SplitPolicy(), scorer.config)


def test_the_shipped_sm90_rules_are_the_committed_sweep():
    """Like the measured backend order: the package data equals what the sweep it names implies."""
    table = json.loads(TABLE.read_text())
    sweep = json.loads((ROOT / "benchmarks" / "results" / table["source"]).read_text())
    assert table["rules"]["sm90"] == rules_from_sweep(sweep["rows"], SHAPES), (
        f"run: python tools/sweep_triton_mla.py --apply benchmarks/results/{table['source']}")


def test_rules_from_a_sweep_pick_the_best_mean_per_shape_and_close_with_a_catch_all():
    rows = [
        {"workload": "a", "block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "us": 100.0},
        {"workload": "a", "block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2, "us": 90.0},
        {"workload": "b", "block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "us": 10.0},
        {"workload": "b", "block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2, "us": 20.0},
        {"workload": "c", "block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2, "us": 5.0},
        {"workload": "c", "split_waves": 4.0, "us": 1.0},  # a split setting: not a tile
        {"workload": "c", "block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 2, "error": "x"},
    ]
    rules = rules_from_sweep(rows, {"a": (128, 1), "b": (128, 1), "c": (16, 64)})
    # a and b share a shape: 16/64 scores (1.11 + 1) / 2, 64/32 (1 + 2) / 2
    assert [r["config"]["block_h"] for r in rules] == [16, 16] and rules[0]["config"]["block_n"] == 64
    assert (rules[0]["min_heads"], rules[0]["min_page_size"]) == (128, 1)
    assert (rules[-1]["min_heads"], rules[-1]["min_page_size"]) == (1, 1)


def test_rules_keep_a_deferred_pv_and_split_waves_and_leave_defaults_unsaid():
    tile = {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
    rows = [
        {"workload": "a", **tile, "defer_pv": True, "split_waves": 1.0, "us": 80.0},
        {"workload": "a", **tile, "defer_pv": False, "split_waves": 0.0, "us": 90.0},
        {"workload": "b", **tile, "us": 50.0},  # an older sweep's row: no deferred PV, the backend's waves
        {"workload": "b", **tile, "defer_pv": True, "us": 70.0},
    ]
    rules = rules_from_sweep(rows, {"a": (128, 64), "b": (16, 1)})
    assert rules[0]["config"] == {**tile, "defer_pv": True, "split_waves": 1.0}
    assert rules[1]["config"] == tile  # the defaults won: not written
    assert tiles.parse_rules({"rules": {"default": rules}})["default"][0].config == MLADecodeConfig(64, 32, 8, 2, True, 1.0)


def test_write_rules_replaces_one_arch_and_refuses_a_table_without_a_default(tmp_path):
    path = tmp_path / tiles.TABLE_FILE
    shutil.copy(TABLE, path)
    new = [{"config": {"block_h": 128, "block_n": 16, "num_warps": 16, "num_stages": 2}, "min_heads": 1,
            "min_page_size": 1}]
    write_rules("sm90", new, "sweep.json", path)
    parsed = tiles.parse_rules(json.loads(path.read_text()))
    assert parsed["sm90"][0].config == MLADecodeConfig(128, 16, 16, 2) and len(parsed["sm80"]) == 1
    before = path.read_text()
    with pytest.raises(ValueError, match="must end in one with min_heads 1"):
        write_rules("sm90", [{**new[0], "min_heads": 64}], "sweep.json", path)
    assert path.read_text() == before  # nothing half-written


def test_the_switch_race_checks_every_candidate_against_the_oracle_and_refuses_an_unknown_switch():
    """sweep_triton_mla.py --gluon-set on the interpreter's tiny workloads: each round runs the shipped tiles and each
    candidate on every decode workload, checked against the oracle (the Gluon kernels do not run on a CPU, so the
    switch changes nothing here: the rows' errors match; on a GPU they run compiled); a misspelt switch stops before
    any run."""
    import argparse

    from script_loader import load_script

    sweep = load_script("tools/sweep_triton_mla.py")
    args = argparse.Namespace(tiny=True, gluon_set=["SEESAW_WHOLE_TILES=1"], rounds=2, budget_s=600.0)
    result = sweep.race_switches(args)
    rows = result["rows"]
    assert {r["switches"] for r in rows} == {"(shipped)", "SEESAW_WHOLE_TILES=1"}
    assert {r["round"] for r in rows} == {0, 1} and all("error" not in r for r in rows)
    assert all(r["rel_err"] < 1e-2 for r in rows)
    by = {(r["workload"], r["switches"], r["round"]): r["rel_err"] for r in rows}
    assert result["gpu"] != "cpu (interpreter)" or all(
        by[(w, "SEESAW_WHOLE_TILES=1", k)] == err for (w, s, k), err in by.items() if s == "(shipped)")
    with pytest.raises(SystemExit, match="no switch 'NOPE'"):
        sweep.race_switches(argparse.Namespace(tiny=True, gluon_set=["NOPE=1"], rounds=1, budget_s=10.0))
