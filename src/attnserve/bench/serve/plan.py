"""What a sweep will do, parsed from the command line: the server configurations and the load points.

A configuration is either a running server (`--url`) or `attnserve serve` flags to
launch (`--launch`, one per `--backends` entry or `--compare` item, each on top of
the `--launch` flags so that exactly one thing differs). A `--compare` item `spec=NAME`
is short for `spec-NAME=--speculative-algorithm NAME`: speculation on, one flag. Load points are the
closed-loop concurrencies then the open-loop rates, each with its number of seeds
and prompts. Every bad value is refused here, before any server starts.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from attnserve.bench.serve.load import LoadPoint

_LABELLED = re.compile(r"^([A-Za-z0-9_.+-]+)=(.*)$", re.S)


@dataclass(frozen=True)
class ServerConfig:
    label: str
    url: str | None = None  # a running server
    flags: str | None = None  # `attnserve serve` flags to launch with


@dataclass(frozen=True)
class PlannedPoint:
    load: LoadPoint
    seeds: tuple[int, ...]
    num_prompts: int


def _labelled(text: str) -> tuple[str | None, str]:
    """'name=rest' -> (name, rest) unless it starts like a flag or a URL; else (None, text)."""
    m = _LABELLED.match(text.strip())
    if m and not text.strip().startswith("-") and "://" not in m.group(1):
        return m.group(1), m.group(2)
    return None, text


def server_configs(
    url: list[str] | None, launch: str | None, backends: str | None, compare: list[str] | None
) -> list[ServerConfig]:
    launching = launch is not None or backends or compare
    if not url and not launching:
        raise ValueError(
            'no server: give --url http://host:port (a running server) or --launch "serve flags" '
            '(with --backends a,b or --compare "flags A" "flags B" to compare configurations)'
        )
    configs: list[ServerConfig] = []
    for u in url or []:
        label, address = _labelled(u)
        if not re.match(r"^https?://[^/\s]+", address):
            raise ValueError(f"--url {u!r}: expected http://host:port (optionally label=http://host:port)")
        configs.append(ServerConfig(label or address.rstrip("/"), url=address.rstrip("/")))
    if not launching:
        return configs
    base = launch or ""
    if backends and compare:
        raise ValueError("--backends and --compare both give the configurations to launch; use one of them")
    if backends:
        names = [b.strip() for b in backends.split(",")]
        if not all(names):
            raise ValueError(
                f"--backends {backends!r}: expected comma-separated backend names, e.g. triton,flashinfer"
            )
        configs += [
            ServerConfig(n, flags=f"{base} --attention-backend {shlex.quote(n)}".strip()) for n in names
        ]
    elif compare:
        for item in compare:
            label, flags = _labelled(item)
            name = flags.strip()
            if label == "spec" and name and not name.startswith("-"):
                label, flags = f"spec-{name}", f"--speculative-algorithm {shlex.quote(name)}"
            configs.append(
                ServerConfig(label or (flags.strip() or "default"), flags=f"{base} {flags}".strip())
            )
    else:
        configs.append(ServerConfig(base.strip() or "default", flags=base))
    labels = [c.label for c in configs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"configuration labels must differ, {dup} repeats; name them as label=flags")
    return configs


def _numbers(text: str, what: str, parse, allowed: str) -> list:
    try:
        values = [parse(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{what} {text!r}: expected {allowed}")
    return values


def _positive_int(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError(x)
    return v


def _rate(x: str) -> float:
    v = float(x)
    if math.isnan(v) or v <= 0:
        raise ValueError(x)
    return v


def _prompts_for(num_prompts: str, load: LoadPoint) -> int:
    """'N' prompts, or 'Nx': N per client (closed loop) / N seconds of arrivals (open loop)."""
    text = num_prompts.strip().lower()
    try:
        per = float(text[:-1]) if text.endswith("x") else None
        fixed = None if per is not None else int(text)
    except ValueError:
        per = fixed = None
    if (per is None and fixed is None) or (fixed is not None and fixed < 1) or (per is not None and per <= 0):
        raise ValueError(
            f"--num-prompts {num_prompts!r}: expected a count like 64, or 'Nx' (e.g. 4x: 4 per "
            "client at each concurrency, 4 seconds of arrivals at each rate)"
        )
    if fixed is not None:
        return fixed
    if math.isinf(load.value):
        raise ValueError(f"--num-prompts {num_prompts!r} with --request-rate inf: give a plain count")
    return max(1, math.ceil(per * load.value))


def load_points(
    concurrency: str | None, request_rate: str | None, seeds: str, seed: int, num_prompts: str
) -> list[PlannedPoint]:
    loads = []
    if concurrency:
        loads += [
            LoadPoint("concurrency", c)
            for c in _numbers(
                concurrency, "--concurrency", _positive_int, "comma-separated integers >= 1, e.g. 1,8,32"
            )
        ]
    if request_rate:
        loads += [
            LoadPoint("rate", r)
            for r in _numbers(
                request_rate, "--request-rate", _rate, "comma-separated requests/s > 0 or inf, e.g. 4,16,inf"
            )
        ]
    if not loads:
        raise ValueError("no load: give --concurrency and/or --request-rate")
    counts = _numbers(seeds, "--seeds", _positive_int, "a count >= 1, or one count per load point")
    if len(counts) == 1:
        counts = counts * len(loads)
    if len(counts) != len(loads):
        raise ValueError(
            f"--seeds {seeds!r}: {len(counts)} counts for {len(loads)} load points "
            f"({', '.join(p.label for p in loads)}); give one count, or one per point"
        )
    prompts = [x for x in num_prompts.split(",") if x.strip()] or [num_prompts]
    if len(prompts) == 1:
        prompts = prompts * len(loads)
    if len(prompts) != len(loads):
        raise ValueError(
            f"--num-prompts {num_prompts!r}: {len(prompts)} values for {len(loads)} load points; "
            "give one, or one per point"
        )
    return [
        PlannedPoint(p, tuple(range(seed, seed + n)), _prompts_for(k, p))
        for p, n, k in zip(loads, counts, prompts)
    ]
