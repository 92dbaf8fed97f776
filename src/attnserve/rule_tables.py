"""Measured tile tables shipped as package data: one JSON file per kernel family, a list of rules per GPU
architecture, rewritten from a GPU sweep by the tools that measured them."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path


def package_file(package: str, name: str) -> Path:
    return Path(str(resources.files(package).joinpath(name)))


def read_table(package: str, name: str) -> dict:
    """A shipped table as JSON (read through importlib.resources, so it also works from a wheel)."""
    return json.loads(resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def write_arch_rules(path: Path, arch: str, rules: list[dict], source: str, check: Callable[[dict], object]) -> Path:
    """Replace one architecture's rules in the table at `path`; `check(table)` raises before anything malformed
    is written."""
    table = json.loads(path.read_text())
    table["rules"][arch] = rules
    table["source"] = source
    check(table)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path
