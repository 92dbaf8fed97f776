"""Tune results in the user's cache: where they live, what makes one apply, and reading them safely.

`attnserve tune` races the backends on one model's attention shape on this machine and
writes `tune-<machine>-<shape>.json` under the cache directory ($ATTNSERVE_CACHE_DIR,
default ~/.cache/attnserve). Selection prefers its winner per side when the result was
taken on this machine (same device name), for the same shape (heads per rank, widths,
MLA or not, KV dtype, page size) and with the same package versions; a result from other
versions is stale (a kernel package upgrade can change which backend is fastest) and is
reported, not used. A file that can't be read or parsed is reported and skipped: a
broken cache never stops the engine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from attnserve.hardware import Hardware
from attnserve.shape import AttentionShape
from attnserve.versions import package_versions, version_changes

RESULT_KIND = "attnserve-tune"
SCHEMA = 1


def cache_dir() -> Path:
    """$ATTNSERVE_CACHE_DIR, else ~/.cache/attnserve."""
    env = os.environ.get("ATTNSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attnserve"


def shape_key(model: AttentionShape, kv_cache_dtype: str, page_size: int) -> dict:
    """What a kernel's speed depends on in a model, as one rank sees it (names and layer counts don't matter)."""
    return {
        "attention": "MLA" if model.is_mla else "MHA/GQA",
        "num_q_heads": model.num_q_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "v_head_dim": model.v_head_dim,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "sliding_window": model.sliding_window is not None,
        "attention_sinks": model.has_sinks,
        "logit_softcap": model.logit_softcap is not None,
        "kv_cache_dtype": kv_cache_dtype,
        "page_size": page_size,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_path(machine: str, key: dict, directory: Path | None = None) -> Path:
    """One file per machine and shape: a new tune of the same pair replaces the old one."""
    attn = "mla" if key["attention"] == "MLA" else "gqa"
    shape = (f"{attn}{key['num_q_heads']}x{key['num_kv_heads']}-d{key['head_dim']}"
             + (f"v{key['v_head_dim']}" if key["v_head_dim"] != key["head_dim"] else "")
             + "".join(f"-{flag.replace('_', '')}" for flag in ("sliding_window", "attention_sinks", "logit_softcap")
                       if key[flag])
             + f"-{key['kv_cache_dtype']}-p{key['page_size']}")
    return (directory or cache_dir()) / f"tune-{_slug(machine)}-{shape}.json"


@dataclass(frozen=True)
class SideWinner:
    backend: str
    runner_up: str | None  # the next best backend, None when it raced alone
    ratio: float | None  # runner-up's score / the winner's: how much faster the winner measured


@dataclass(frozen=True)
class TunedChoice:
    path: Path
    date: str
    winners: dict[str, SideWinner]  # side -> winner


def winners_of(result: dict) -> dict[str, SideWinner]:
    out = {}
    for side, w in (result.get("winners") or {}).items():
        if isinstance(w, dict) and isinstance(w.get("backend"), str):
            out[side] = SideWinner(w["backend"], w.get("runner_up"), w.get("ratio"))
    return out


def _read(path: Path) -> dict:
    """The parsed result, or ValueError saying why it can't be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != RESULT_KIND:
        raise ValueError(f"not an attnserve tune result (no \"kind\": \"{RESULT_KIND}\")")
    missing = [k for k in ("machine", "shape", "versions", "winners", "date") if not isinstance(data.get(k), (dict, str))]
    if missing:
        raise ValueError(f"missing or malformed {', '.join(missing)}")
    return data


def find_tuned(hw: Hardware, model: AttentionShape, kv_cache_dtype: str, page_size: int | None,
               directory: Path | None = None) -> tuple[TunedChoice | None, list[str]]:
    """(the newest current result for this machine and shape or None, notes for the trace).

    Notes name every file that could not be read, every stale result for this machine and
    shape (with the versions that changed), and, when nothing matched, where it looked.
    """
    directory = directory or cache_dir()
    key = shape_key(model, kv_cache_dtype, page_size if page_size is not None else 1)
    notes: list[str] = []
    try:
        paths = sorted(directory.glob("tune-*.json"))
    except OSError as exc:
        return None, [f"tune results not read: {directory}: {exc}"]
    now = package_versions()
    current: list[tuple[str, Path, dict]] = []
    others = 0
    for path in paths:
        try:
            data = _read(path)
        except ValueError as exc:
            notes.append(f"ignored unreadable tune result {path}: {exc}")
            continue
        if data["machine"] != hw.name or data["shape"] != key:
            others += 1
            continue
        changes = version_changes(data["versions"], now)
        if changes:
            notes.append(f"stale tune result {path} ({data['date']}): taken with other versions "
                         f"({'; '.join(changes)}); not used, run `attnserve tune` again")
            continue
        current.append((str(data["date"]), path, data))
    if not current:
        if not any(n.startswith("stale") for n in notes):
            notes.append(f"no tune result for this machine and model shape in {directory}"
                         + (f" ({others} for other machines or shapes)" if others else "")
                         + "; `attnserve tune` measures one")
        return None, notes
    date, path, data = max(current, key=lambda c: c[0])
    return TunedChoice(path, date, winners_of(data)), notes


__all__ = ["RESULT_KIND", "SCHEMA", "SideWinner", "TunedChoice", "cache_dir", "find_tuned", "result_path",
           "shape_key", "winners_of"]
