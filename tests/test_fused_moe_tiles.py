"""The fused MoE tile table: the shipped file parses, rules match by token count and shape, a sweep's winners
become rules that the table then returns."""

import json
import shutil

import pytest

from attnserve.ops import moe_tiles
from attnserve.ops.moe_tiles import GemmTile, MoETiles, parse_rules, rules_from_sweep, tiles_for, write_rules
from attnserve.rule_tables import package_file

SHAPE = {"experts": 64, "hidden": 2048, "intermediate": 1408, "top_k": 6}


def test_shipped_table_has_a_default_for_every_batch():
    rules = moe_tiles.shipped_rules()
    assert "default" in rules
    small, large = tiles_for("sm_unknown", 1, SHAPE), tiles_for("sm_unknown", 1 << 20, SHAPE)
    assert small.block_m <= large.block_m  # one token's row blocks are no wider than a prefill's


def _tiles(block_m, n):
    return MoETiles(block_m, GemmTile(n, 64, 4, 3), GemmTile(n, 128, 4, 3)).to_json()


def test_sweep_winners_become_rules_for_the_shape_then_for_any(tmp_path):
    best = [{"tokens": 1, "tiles": _tiles(16, 32), "measured_us": {"1 tokens": 30.0}},
            {"tokens": 8, "tiles": _tiles(16, 32), "measured_us": {"8 tokens": 80.0}},
            {"tokens": 64, "tiles": _tiles(16, 64)},
            {"tokens": 512, "tiles": _tiles(64, 128)}]
    rules = rules_from_sweep(best, SHAPE)
    assert [r.get("max_tokens") for r in rules] == [8, 64, 512, 8, 64, None]
    assert rules[0]["measured_us"] == {"1 tokens": 30.0, "8 tokens": 80.0}
    path = tmp_path / "table.json"
    shutil.copy(package_file(moe_tiles.TABLE_PACKAGE, moe_tiles.TABLE_FILE), path)
    write_rules("sm90", rules, "a test sweep", path)
    table = parse_rules(json.loads(path.read_text()))
    other = dict(SHAPE, hidden=4096)
    assert tiles_for("sm90", 1, SHAPE, table) == MoETiles.from_json(_tiles(16, 32))
    assert tiles_for("sm90", 9, SHAPE, table) == MoETiles.from_json(_tiles(16, 64))
    assert tiles_for("sm90", 100_000, SHAPE, table) == MoETiles.from_json(_tiles(64, 128))
    assert tiles_for("sm90", 9, other, table) == MoETiles.from_json(_tiles(16, 64))  # the any-shape copy
    assert tiles_for("sm80", 1, SHAPE, table) == tiles_for("default", 1, SHAPE, table)


def test_a_table_without_a_catch_all_or_with_bad_tiles_is_refused():
    rule = {"max_tokens": 8, "tiles": _tiles(16, 32)}
    with pytest.raises(ValueError, match="must end in one without max_tokens"):
        parse_rules({"rules": {"default": [rule]}})
    with pytest.raises(ValueError, match="power of two"):
        parse_rules({"rules": {"default": [{"tiles": _tiles(24, 32)}]}})
    with pytest.raises(ValueError, match="shape keys"):
        parse_rules({"rules": {"default": [{**rule, "shape": {"layers": 2}}, {"tiles": _tiles(16, 32)}]}})
