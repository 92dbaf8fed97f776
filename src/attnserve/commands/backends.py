"""`attnserve backends`: every known attention backend, what it supports, and whether it runs here."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from attnserve.choice.registry import ALIASES, REGISTRY, availability
from attnserve.commands.select import add_machine_arguments, hardware_from_args

_FLAG_NAMES = {
    "sliding_window": "window",
    "attention_sinks": "sinks",
    "logit_softcap": "softcap",
    "custom_mask": "mask",
    "asymmetric_kv": "K/V widths differ",
    "spec_topk1": "spec",
    "spec_topk_gt1": "spec tree",
    "cuda_graph": "cuda graph",
    "deterministic": "deterministic",
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "backends",
        help="list attention backends, their features and whether they can run here",
        description="Every attention backend attnserve knows (its own and SGLang's), with features and "
        "the reasons one cannot run on this machine.",
    )
    add_machine_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON object keyed by backend name")
    return p


def backend_entries(hw) -> dict[str, dict[str, Any]]:
    """One entry per registry name and alias: summary, features, and why it can't run on `hw`."""
    entries: dict[str, dict[str, Any]] = {}
    for name, spec in REGISTRY.items():
        try:
            features = _features_dict(spec.features)
            reasons = availability(name, hw)
        except ImportError as exc:  # an implementation module that is missing or broken here
            features = None
            reasons = [f"implementation cannot be imported: {exc}"]
        entries[name] = {
            "summary": spec.summary,
            "implemented": spec.implemented,
            "removed": spec.removed,
            "available": not reasons,
            "reasons": reasons,
            "features": features,
        }
    for alias, target in sorted(ALIASES.items()):
        entries[alias] = {**entries[target], "alias_of": target}
    return entries


def run(args) -> int:
    hw = hardware_from_args(args)
    entries = backend_entries(hw)
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        _print_table(entries, hw)
    return 0


def _features_dict(features) -> dict[str, Any]:
    d = dataclasses.asdict(features)
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in d.items()}


def _describe(f: dict[str, Any] | None) -> str:
    if f is None:
        return "?"
    parts = ["/".join(t for t in ("MHA", "GQA", "MLA") if t in f["attention_types"])]
    parts.append("page " + ("any" if f["page_sizes"] is None else "/".join(map(str, f["page_sizes"]))))
    parts.append("kv " + ",".join(f["kv_dtypes"]))
    if not f["prefill"] or not f["decode"]:
        parts.append("prefill only" if f["prefill"] else "decode only")
    flags = [label for key, label in _FLAG_NAMES.items() if f.get(key)]
    if flags:
        parts.append(", ".join(flags))
    where = ",".join(f["devices"])
    if f["compute_capabilities"]:
        where += " sm" + "/".join(f"{m}x" for m in f["compute_capabilities"])
    parts.append(where)
    return "; ".join(parts)


def _print_table(entries: dict[str, dict[str, Any]], hw) -> None:
    table = Table(title=f"attention backends on {hw.describe()}")
    table.add_column("backend", style="bold", no_wrap=True)
    table.add_column("runs here", no_wrap=True)
    table.add_column("features")
    table.add_column("why not")
    for name, e in entries.items():
        label = f"{name} (= {e['alias_of']})" if "alias_of" in e else name
        ok = "[green]yes[/green]" if e["available"] else "[red]no[/red]"
        table.add_row(label, ok, _describe(e["features"]), "; ".join(e["reasons"]))
    Console().print(table)
    runnable = [n for n, e in entries.items() if e["available"]]
    Console().print(f"{len(runnable)} of {len(entries)} run here: {', '.join(runnable) or 'none'}")
