"""The fallback order measured per GPU model and attention type, shipped inside the package.

`measured_order.json` (package data, so an installed wheel has it) holds, per GPU key (e.g. 'h100') and
attention type ('MHA' for MHA/GQA, 'MLA'), the implemented backends fastest first on each side and
each one's score (its mean time relative to the fastest backend of each workload, `ranking.rank`),
from a committed `attnserve bench kernels` run (`source` names it). MHA and MLA are ranked apart:
a backend's MLA kernels are different kernels from its MHA ones, so an MLA model must not inherit
the MHA order. A race over several head counts also ships an order per head count (`by_heads`),
and a model takes the one raced nearest its query heads per rank, since the fastest MLA decode
kernel can differ between many heads (one GPU) and few (tensor parallel).

The package-data builder (`tools/ship_measured_order.py`, given the race result files) regenerates
the file after a new race, each result filling the attention types it raced; a test checks the
shipped order still matches the committed races.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

from attnserve.choice.ranking import ATTENTION_TYPES, attention_of, heads_of, rank
from attnserve.hardware import Hardware

DATA_FILE = "measured_order.json"
SIDES = ("prefill", "decode")


def gpu_key(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the first word after the vendor (the file names of races use it)."""
    words = name.lower().replace("nvidia", "").split()
    return words[0] if words else ""


def _orders(records: list[dict], attention: str) -> dict:
    """The order per side and each backend's score per side (1.0 = fastest on every workload)."""
    ranked = {side: rank(records, side, attention=attention) for side in SIDES}
    return {**{side: [r.backend for r in ranked[side]] for side in SIDES},
            "scores": {side: {r.backend: round(r.score, 2) for r in ranked[side]} for side in SIDES}}


def order_entry(result: dict, source: str) -> dict[str, dict]:
    """What the package ships for one race result, per attention type it raced: its date and GPU, the
    orders over all its workloads and, where it raced two or more head counts, per head count."""
    records = result.get("records", [])
    out = {}
    for attention in ATTENTION_TYPES:
        mine = [r for r in records if attention_of(r) == attention]
        if not mine:
            continue
        out[attention] = {"gpu": result.get("gpu"), "date": result.get("date"), "source": source,
                          **_orders(mine, attention)}
        heads = sorted({h for r in mine if (h := heads_of(r)) is not None})
        if len(heads) > 1:
            out[attention]["by_heads"] = {str(h): _orders([r for r in mine if heads_of(r) == h], attention)
                                          for h in heads}
    return out


@functools.cache
def _shipped() -> dict:
    text = resources.files("attnserve.choice").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def attention_key(attention_type: str) -> str:
    """A model's attention type as the shipped data keys it: 'MLA', else 'MHA' (MHA and GQA race alike)."""
    return "MLA" if attention_type == "MLA" else "MHA"


def measured_order(hw: Hardware, side: str, attention: str = "MHA",
                   heads: int | None = None) -> tuple[tuple[str, ...], dict] | None:
    """(backends fastest first on `side` for `attention` models, the entry they came from) for this GPU
    model; None off CUDA, or for a GPU or attention type no race was shipped for. `heads`: the model's
    query heads per rank; where the race has orders per head count, the nearest raced count's (by
    ratio; the entry then names it under "heads")."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)}, got {side!r}")
    if hw.device != "cuda" or not hw.name:
        return None
    entry = _shipped().get(gpu_key(hw.name), {}).get(attention_key(attention))
    if not entry or not entry.get(side):
        return None
    by_heads = entry.get("by_heads") or {}
    if heads and by_heads:
        nearest = min(by_heads, key=lambda h: (abs(math.log2(int(h) / heads)), -int(h)))
        if by_heads[nearest].get(side):
            entry = {**{k: v for k, v in entry.items() if k != "by_heads"}, **by_heads[nearest],
                     "heads": int(nearest)}
    return tuple(entry[side]), entry


def describe_order(entry: dict, side: str) -> str:
    """'flashinfer 1.00x, triton 5.38x': the order with each backend's measured score (its mean time
    relative to each workload's fastest)."""
    scores = entry.get("scores", {}).get(side, {})
    return ", ".join(f"{name} {scores[name]:.2f}x" if name in scores else name for name in entry[side])


__all__ = ["DATA_FILE", "attention_key", "describe_order", "gpu_key", "measured_order", "order_entry"]
