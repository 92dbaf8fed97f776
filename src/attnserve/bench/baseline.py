"""A regression guard: a run's times against a stored run of the same machine and shapes.

Used by `bench kernels --baseline OLD.json`, `tune --baseline OLD.json`, and `bench compare NEW OLD`
(two stored runs). Each backend/workload timed in both gets the ratio new / old; one above
1 + threshold is a regression, and so is a backend that ran in the old run and now fails or
is disqualified. Exit status 3 names them all. Runs on different machines or shapes are not
compared: the numbers would say nothing about a regression.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

REGRESSION_EXIT = 3
DEFAULT_THRESHOLD = 0.10


def add_guard_arguments(p: argparse.ArgumentParser) -> None:
    """--baseline / --regression-threshold, shared by `bench kernels` and `tune`."""
    p.add_argument("--baseline", type=Path, default=None, metavar="OLD.json",
                   help="compare with a stored run of the same machine and shapes; exit 3 if anything slowed")
    p.add_argument("--regression-threshold", type=_threshold, default=DEFAULT_THRESHOLD, metavar="FRACTION",
                   help=f"with --baseline: how much slower counts as a regression (default {DEFAULT_THRESHOLD}: 10%%)")


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0.10 = 10% slower), got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0.10 = 10% slower), got {text}")
    return value


def load_run(path: Path) -> dict:
    """A stored run, or ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"run {path} can't be read: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        # a bad input file, reported like any other bad value
        raise ValueError(f"run {path} is not a run of `attnserve bench kernels` or `attnserve tune` "  # noqa: TRY004
                         "(no \"records\" list)")
    return data


def identity(run: dict) -> tuple[str, str, dict]:
    """(what made it, the machine, its shapes): a kernel race and a tune run are not comparable."""
    if run.get("kind") == "attnserve-tune":
        return "tune", str(run.get("machine")), dict(run.get("shape") or {})
    return "bench kernels", str(run.get("gpu")), dict(run.get("shapes") or {})


def check_comparable(new: dict, old: dict, old_name: str = "the baseline") -> None:
    """ValueError when the runs differ in kind, machine or any shape field both describe."""
    (kind_n, machine_n, shape_n), (kind_o, machine_o, shape_o) = identity(new), identity(old)
    if kind_n != kind_o:
        raise ValueError(f"not compared: this is a `{kind_n}` run, {old_name} is a `{kind_o}` run")
    if machine_n != machine_o:
        raise ValueError(f"not compared: {old_name} was measured on {machine_o!r}, this run on {machine_n!r}; "
                         "times from different machines say nothing about a regression")
    differ = [f"{k} {shape_o[k]!r} -> {shape_n[k]!r}" for k in sorted(set(shape_n) & set(shape_o))
              if shape_n[k] != shape_o[k]]
    if differ:
        raise ValueError(f"not compared: {old_name} raced other shapes ({'; '.join(differ)})")


@dataclass(frozen=True)
class Row:
    workload: str
    backend: str
    old_us: float
    new_us: float | None  # None: it ran before and now fails
    why_missing: str | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.new_us is None else self.new_us / self.old_us


def _timed(run: dict) -> dict[tuple[str, str], dict]:
    return {(str(r.get("workload")), str(r.get("backend"))): r for r in run["records"] if isinstance(r, dict)}


def compare(new: dict, old: dict, threshold: float) -> tuple[list[Row], list[Row]]:
    """(every row timed in the old run and raced in the new one, the regressions among them)."""
    rows = []
    new_recs = _timed(new)
    for key, old_rec in _timed(old).items():
        old_us = old_rec.get("us")
        if key not in new_recs or not isinstance(old_us, (int, float)) or old_us <= 0:
            continue  # not raced this time (other --backends / --workloads), or never timed
        rec = new_recs[key]
        us = rec.get("us")
        if isinstance(us, (int, float)) and us > 0:
            rows.append(Row(*key, float(old_us), float(us)))
        else:
            rows.append(Row(*key, float(old_us), None, rec.get("failed_check") or rec.get("skipped") or "no time"))
    if not rows:
        raise ValueError("not compared: no backend/workload was timed in both runs")
    slowed = [r for r in rows if r.ratio is None or r.ratio > 1 + threshold]
    return rows, slowed


def report(new: dict, old: dict, old_name: str, threshold: float, console=None) -> int:
    """Print the ratio table; REGRESSION_EXIT naming what slowed, else 0. ValueError when not comparable."""
    check_comparable(new, old, old_name)
    rows, slowed = compare(new, old, threshold)
    console = console or Console()
    table = Table(title=f"against {old_name} ({old.get('date', 'undated')}); regression: > {threshold:.0%} slower")
    for col in ("workload", "backend", "old us", "new us", "new / old", ""):
        table.add_column(col, justify="right" if "us" in col or "/" in col else "left")
    bad = set(map(id, slowed))
    for r in rows:
        verdict = ("[red]no longer runs: " + str(r.why_missing) + "[/red]" if r.new_us is None
                   else "[red]slower[/red]" if id(r) in bad else "ok")
        table.add_row(r.workload, r.backend, f"{r.old_us:.1f}", "-" if r.new_us is None else f"{r.new_us:.1f}",
                      "-" if r.ratio is None else f"{r.ratio:.2f}x", verdict)
    console.print(table)
    if not slowed:
        console.print(f"no regression: {len(rows)} timings within {threshold:.0%} of {old_name}")
        return 0
    named = ", ".join(f"{r.workload} / {r.backend} ({'fails' if r.ratio is None else f'{r.ratio:.2f}x'})"
                      for r in slowed)
    console.print(f"REGRESSION: {len(slowed)} of {len(rows)} slower than {threshold:.0%} allows: {named}",
                  style="bold red", soft_wrap=True)
    return REGRESSION_EXIT


# ---- `attnserve bench compare NEW.json OLD.json` ----------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("new", type=Path, help="the run to judge (bench kernels or tune JSON)")
    p.add_argument("old", type=Path, help="the stored run it must not be slower than")
    p.add_argument("--regression-threshold", type=_threshold, default=DEFAULT_THRESHOLD, metavar="FRACTION",
                   help=f"how much slower counts as a regression (default {DEFAULT_THRESHOLD}: 10%%)")


def run(args) -> int:
    return report(load_run(args.new), load_run(args.old), str(args.old), args.regression_threshold)


__all__ = ["DEFAULT_THRESHOLD", "REGRESSION_EXIT", "Row", "add_guard_arguments", "check_comparable", "compare",
           "identity", "load_run", "report"]
