"""Backends ranked by measured time: one scoring for the shipped race and for `attnserve tune`.

A record is `{"workload", "backend", "us", ...}` as `attnserve bench kernels` and
`attnserve tune` write them. A backend's score is its mean time relative to the fastest
backend of each workload it ran, so backends that ran different workloads still compare;
a contestant named after a variant ('flashinfer-fa3') counts for its registry backend,
whose fastest variant counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.choice.registry import REGISTRY

ATTENTION_TYPES = ("MHA", "MLA")  # raced apart: an MLA kernel's speed says nothing about its MHA one


def backend_family(contestant: str) -> str | None:
    """The implemented registry backend a contestant belongs to ('flashinfer-fa3' -> 'flashinfer'), else None.

    A contestant raced from another install ('flashinfer-fa3@0.7.2.post1', `bench kernels --peer-site`)
    belongs to none: the order ranks what this install runs."""
    if "@" in contestant:
        return None
    for name in (contestant, contestant.split("-")[0]):
        if name in REGISTRY and REGISTRY[name].implemented:
            return name
    return None


def side_of(record: dict) -> str:
    """'decode' or 'prefill' (prefill and extend steps run on the prefill side)."""
    if record.get("side") in ("decode", "prefill"):
        return record["side"]
    return "decode" if "decode" in str(record.get("workload", "")).split() else "prefill"


def attention_of(record: dict) -> str:
    """'MLA' or 'MHA': which attention a race record measured. MLA workloads are named 'mla ...'
    (bench/workloads.py) or carry `"attention": "MLA"`; everything else raced MHA/GQA shapes."""
    if str(record.get("attention", "")).upper() == "MLA":
        return "MLA"
    words = str(record.get("workload", "")).split()
    return "MLA" if words and words[0] == "mla" else "MHA"


def heads_of(record: dict) -> int | None:
    """The query heads a record raced, from its workload name's 'h<N>' ('mla decode 128x4096 h16 p64' -> 16);
    None when it names none (the MHA race's shapes are fixed)."""
    for word in str(record.get("workload", "")).split():
        if len(word) > 1 and word[0] == "h" and word[1:].isdigit():
            return int(word[1:])
    return None


@dataclass(frozen=True)
class Ranked:
    backend: str
    score: float  # mean of time / fastest time over the workloads it ran; 1.0 = fastest everywhere
    workloads: int


def rank(records: list[dict], side: str | None = None, complete_only: bool = False,
         attention: str | None = None) -> list[Ranked]:
    """Backends fastest first on `side`'s workloads (None: all) of one attention type ('MHA', 'MLA';
    None: all). `complete_only`: a backend that has no time for one of the side's workloads (it failed
    or was skipped) is left out, since it can't serve it."""
    if attention is not None and attention not in ATTENTION_TYPES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_TYPES)} or None, got {attention!r}")
    times: dict[str, dict[str, float]] = {}
    for rec in records:
        family = backend_family(str(rec.get("backend", "")))
        t = rec.get("us")
        if family is None or "workload" not in rec or (side is not None and side_of(rec) != side) or (
                attention is not None and attention_of(rec) != attention):
            continue
        per = times.setdefault(str(rec["workload"]), {})
        if isinstance(t, (int, float)) and t > 0:
            per[family] = min(t, per.get(family, t))
    ratios: dict[str, list[float]] = {}
    for per in times.values():
        if per:
            best = min(per.values())
            for name, t in per.items():
                ratios.setdefault(name, []).append(t / best)
    if complete_only:
        ratios = {n: r for n, r in ratios.items() if len(r) == len(times)}
    ranked = [Ranked(n, sum(r) / len(r), len(r)) for n, r in ratios.items()]
    return sorted(ranked, key=lambda x: (x.score, x.backend))


__all__ = ["ATTENTION_TYPES", "Ranked", "attention_of", "backend_family", "heads_of", "rank", "side_of"]
