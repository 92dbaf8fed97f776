"""How evenly the Gluon prefill's persistent programs share a call's work list, on a cost model, before a GPU says.

The list is prefill_gluon's: query tiles of 128 rows heaviest first (build_extend_tiles' order), KV head by KV head,
the query heads of a KV head fastest. An item costs the key tiles it reads plus `--item-cost` tiles for its start
and end (the first S waited for, the last P.V, the store). Printed for each schedule, the busiest program's cost
over the mean (1.0 = even):

- static: program p takes items p, p + P, p + 2P, ... (the kernel's default);
- claimed: each item, in list order, to the program that comes free first (the kernel's DYNAMIC_ITEMS);
- lpt: the whole list by cost, each item to the least loaded program (a bound no list order beats by much).

    python3 tools/work_list_balance.py [--sms 132] [--heads 32 --kv-heads 8] [--item-cost 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys

BLOCK = 128  # query rows of a tile and keys of a key tile (prefill_gluon.BLOCK_M, BLOCK_N)
# (requests, new tokens each, cached prefix each): the race's prefill and extend cases
CASES = {"prefill 8x2048": (8, 2048, 0), "prefill 1x16384": (1, 16384, 0), "prefill 4x4096": (4, 4096, 0),
         "prefill 32x512": (32, 512, 0), "extend 8x(4096+512)": (8, 512, 4096)}


def item_costs(requests: int, new: int, prefix: int, heads: int, kv_heads: int, item_cost: float) -> list[float]:
    """Each item's cost in the kernel's list order."""
    key_tiles = sorted((-(-(prefix + min(m0 + BLOCK, new)) // BLOCK) for _ in range(requests)
                        for m0 in range(0, new, BLOCK)), reverse=True)
    group = heads // kv_heads
    return [t + item_cost for _ in range(kv_heads) for t in key_tiles for _ in range(group)]


def static_loads(costs: list[float], programs: int) -> list[float]:
    loads = [0.0] * programs
    for w, c in enumerate(costs):
        loads[w % programs] += c
    return loads


def greedy_loads(costs: list[float], programs: int) -> list[float]:
    """Each cost in turn to the program with the least so far (the one that comes free first)."""
    heap = [(0.0, p) for p in range(programs)]
    for c in costs:
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + c, p))
    return [load for load, _ in heap]


def balance(costs: list[float], programs: int) -> dict[str, float]:
    mean = sum(costs) / programs
    return {"items": len(costs),
            "static": round(max(static_loads(costs, programs)) / mean, 4),
            "claimed": round(max(greedy_loads(costs, programs)) / mean, 4),
            "lpt": round(max(greedy_loads(sorted(costs, reverse=True), programs)) / mean, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", type=int, default=132, help="programs (an H100 SXM's SMs; an H200 has 132 too)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--item-cost", type=float, default=0.5, help="key tiles' worth of time an item's start and end take")
    args = p.parse_args(argv)
    for name, (requests, new, prefix) in CASES.items():
        costs = item_costs(requests, new, prefix, args.heads, args.kv_heads, args.item_cost)
        print(json.dumps({"case": name, **balance(costs, min(args.sms, len(costs)))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
