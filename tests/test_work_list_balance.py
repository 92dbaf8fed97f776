"""tools/work_list_balance.py: the cost model behind the Gluon prefill's DYNAMIC_ITEMS, on the CPU."""


import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def balance_tool():
    return load_script("tools/work_list_balance.py")


def test_the_list_is_the_kernels_order(balance_tool):
    # 2 requests of 256 new tokens behind 128 cached ones, 4 query heads over 2 KV heads: tiles of 3, 3, 2, 2 key
    # tiles, heaviest first, each KV head's list with its 2 query heads fastest
    assert balance_tool.item_costs(2, 256, 128, 4, 2, 0.5) == [3.5] * 4 + [2.5] * 4 + [3.5] * 4 + [2.5] * 4


def test_static_rounds_leave_the_programs_with_an_extra_item_busiest(balance_tool):
    costs = balance_tool.item_costs(1, 16384, 0, 32, 8, 0.5)
    out = balance_tool.balance(costs, 132)
    # 4,096 items over 132 programs: four take 32, and every program's items average the mean cost here
    assert out["items"] == 4096 and out["static"] == pytest.approx(32 / (4096 / 132), abs=1e-4)
    assert out["claimed"] < out["static"] and out["lpt"] <= out["claimed"]


def test_an_even_split_of_equal_items_is_even_under_every_schedule(balance_tool):
    out = balance_tool.balance([2.0] * 264, 132)
    assert out == {"items": 264, "static": 1.0, "claimed": 1.0, "lpt": 1.0}


def test_claiming_beats_the_static_split_on_every_race_case(balance_tool):
    for requests, new, prefix in balance_tool.CASES.values():
        out = balance_tool.balance(balance_tool.item_costs(requests, new, prefix, 32, 8, 0.5), 132)
        assert out["claimed"] < out["static"]
