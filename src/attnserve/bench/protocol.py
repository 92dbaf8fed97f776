"""The kernel race's protocol for ratios near 1.0: several runs, alternated order, ratios as ranges.

A single run's ratio moved 9% between two runs of the same peer (FlashInfer's fa3 prefill), so one
number says less than it seems. The race therefore:

- runs the whole field `runs` times, the contestants' order reversed on every other run, so a drift
  over the run (clocks, temperature, a neighbour) does not favour whoever runs first;
- keeps each run's time (`us_runs`), reports the median as `us` (what `bench compare`, the README
  tables and the shipped selection order read), and each ratio as its median and its range over
  runs (`*_range`), computed from the two contestants' times *of the same run*;
- can race peers from another install (another FlashInfer) in a child process, whose rows come back
  labelled `name@version` (`label_peer_records`, `merge_peer_records`).

Everything here is pure: the GPU work is in kernels.py and timing.py.
"""

from __future__ import annotations

import statistics

OURS = frozenset({"triton", "torch_native"})  # attnserve's own contestants; every other one is a peer
RATE_FIELDS = ("tbps", "tflops", "pct_of_ceiling")


def run_order(names: list[str], run_index: int) -> list[str]:
    """The contestants' order for run `run_index`: as given on even runs, reversed on odd ones."""
    return list(names) if run_index % 2 == 0 else list(reversed(names))


def is_peer(name: str) -> bool:
    return name not in OURS


def combine_runs(runs: list[list[dict]]) -> list[dict]:
    """One record per (workload, backend) from several runs of the race.

    The first run's record is the base (its correctness check, kernel path, skip reason); `us_runs`
    holds every run's time (None where that run did not time it), `us` their median, and the rates
    are rescaled to the median time. A contestant no run timed keeps the first run's record as it was.
    """
    order: list[tuple[str, str]] = []
    per: dict[tuple[str, str], list[dict | None]] = {}
    for i, records in enumerate(runs):
        for rec in records:
            key = (rec["workload"], rec["backend"])
            if key not in per:
                order.append(key)
                per[key] = [None] * len(runs)
            per[key][i] = rec
    out = []
    for key in order:
        recs = per[key]
        base = dict(next(r for r in recs if r is not None))
        times = [r.get("us") if r is not None else None for r in recs]
        timed = [t for t in times if isinstance(t, (int, float)) and t > 0]
        if len(runs) > 1:
            base["us_runs"] = times
        if timed:
            first = next(r for r in recs if r is not None and r.get("us") == timed[0])
            med = statistics.median(timed)
            for f in RATE_FIELDS:
                if f in first:
                    base[f] = round(first[f] * timed[0] / med, 3)
            base["us"] = round(med, 2)
            base.pop("skipped", None)
            if len(timed) < len(runs):
                base["runs_without_time"] = len(runs) - len(timed)
        out.append(base)
    return out


def _runs_of(rec: dict) -> list[float | None]:
    """A record's time per run (one entry when it has no `us_runs`)."""
    if "us_runs" in rec:
        return list(rec["us_runs"])
    return [rec.get("us")]


def ratio_range(peer_runs: list[float | None], ours_runs: list[float | None]) -> list[float] | None:
    """[min, max] over runs of peer time / our time, each run against itself; None when no run timed both."""
    ratios = [p / o for p, o in zip(peer_runs, ours_runs) if p and o]
    if not ratios:
        return None
    return [round(min(ratios), 3), round(max(ratios), 3)]


def add_ratios(records: list[dict], peer_name: str | None) -> None:
    """Ratios of one workload's records (> 1: faster than the other):

    - `vs_flashinfer` / `flashinfer_peer`: against `peer_name` (the FlashInfer kernel the README has
      always quoted), and `vs_flashinfer_range` over runs;
    - `vs_best_peer` / `best_peer`: against the fastest peer of the workload (any contestant that is not
      attnserve's own, other installs' included), and `vs_best_peer_range` over runs, where each run's
      fastest peer is that run's.
    """
    timed = [r for r in records if isinstance(r.get("us"), (int, float)) and r["us"] > 0]
    peer = next((r for r in timed if r["backend"] == peer_name), None)
    peers = [r for r in timed if is_peer(r["backend"])]
    best = min(peers, key=lambda r: r["us"]) if peers else None
    nruns = max((len(_runs_of(r)) for r in timed), default=1)
    for r in timed:
        mine = _pad(_runs_of(r), nruns)
        if peer is not None:
            r["vs_flashinfer"] = round(peer["us"] / r["us"], 3)
            r["flashinfer_peer"] = peer["backend"]
            if nruns > 1:
                r["vs_flashinfer_range"] = ratio_range(_pad(_runs_of(peer), nruns), mine)
        if best is not None and r is not best:
            r["vs_best_peer"] = round(best["us"] / r["us"], 3)
            r["best_peer"] = best["backend"]
            if nruns > 1:
                rivals = [p for p in peers if p is not r]
                r["vs_best_peer_range"] = ratio_range([_fastest(rivals, i, nruns) for i in range(nruns)], mine)


def _fastest(records: list[dict], run: int, nruns: int) -> float | None:
    """The shortest time any of `records` took in run `run`."""
    times = [t for r in records if (t := _pad(_runs_of(r), nruns)[run])]
    return min(times, default=None)


def _pad(xs: list, n: int) -> list:
    return list(xs) + [None] * (n - len(xs))


def format_ratio(value: float, span: list[float] | None) -> str:
    """'1.02x' or '1.02x (1.01-1.03)' with the range over runs."""
    if span is None or span[0] == span[1] == value:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({span[0]:.2f}-{span[1]:.2f})"


# ---- peers from another install ---------------------------------------------------------------------------
def peer_label(versions: dict, package: str = "flashinfer-python") -> str:
    """'@0.7.2.post1': what tells another install's rows from this one's."""
    return f"@{versions.get(package, 'unknown')}"


def label_peer_records(records: list[dict], label: str, site: str) -> list[dict]:
    """Another install's rows renamed `name@version`, their ratios dropped (the merged race recomputes them)."""
    out = []
    for rec in records:
        r = {k: v for k, v in rec.items() if not k.startswith(("vs_", "flashinfer_peer", "best_peer"))}
        r["backend"] = f"{rec['backend']}{label}"
        r["peer_site"] = site
        out.append(r)
    return out


def merge_peer_records(records: list[dict], extra: list[dict]) -> list[dict]:
    """`extra` rows placed after the rows of their own workload (workloads this run lacks go last)."""
    by_workload: dict[str, list[dict]] = {}
    for r in extra:
        by_workload.setdefault(r["workload"], []).append(r)
    out: list[dict] = []
    for i, r in enumerate(records):
        out.append(r)
        last = i + 1 == len(records) or records[i + 1]["workload"] != r["workload"]
        if last:
            out += by_workload.pop(r["workload"], [])
    for rest in by_workload.values():
        out += rest
    return out


__all__ = ["OURS", "add_ratios", "combine_runs", "format_ratio", "is_peer", "label_peer_records",
           "merge_peer_records", "peer_label", "ratio_range", "run_order"]
