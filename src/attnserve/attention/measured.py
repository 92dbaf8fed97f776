"""The fallback order measured per GPU model, shipped inside the package.

`measured_order.json` (package data, so an installed wheel has it) holds, per GPU key
('h200'), the implemented backends fastest first on each side, computed by `ranking.rank`
from a committed `attnserve bench kernels` run (`source` names it). Regenerate it with
`python benchmarks/ship_measured_order.py benchmarks/results/kernels-<gpu>.json` after a
new race; a test checks the shipped order still matches the committed race.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from attnserve.attention.ranking import rank
from attnserve.hardware import Hardware

DATA_FILE = "measured_order.json"


def gpu_key(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the first word after the vendor (the file names of races use it)."""
    words = name.lower().replace("nvidia", "").split()
    return words[0] if words else ""


def order_entry(result: dict, source: str) -> dict:
    """What the package ships for one race result: its date and GPU, and the order per side."""
    records = result.get("records", [])
    return {"gpu": result.get("gpu"), "date": result.get("date"), "source": source,
            **{side: [r.backend for r in rank(records, side)] for side in ("prefill", "decode")}}


@functools.cache
def _shipped() -> dict:
    text = resources.files("attnserve.attention").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def measured_order(hw: Hardware, side: str) -> tuple[tuple[str, ...], dict] | None:
    """(backends fastest first on `side`, the entry they came from) for this GPU model; None off CUDA or
    for a GPU no race was shipped for."""
    if hw.device != "cuda" or not hw.name:
        return None
    entry = _shipped().get(gpu_key(hw.name))
    if not entry or not entry.get(side):
        return None
    return tuple(entry[side]), entry


__all__ = ["DATA_FILE", "gpu_key", "measured_order", "order_entry"]
