"""Merge the H200 serving run into one record: our sweep, the peer's, the offline engine, the targets.

Inputs are the JSON files `benchmarks/h200.sh serve` wrote: `attnserve bench serve` against our
servers, the same tool against the peer (`transformers serve`), and
`benchmarks/engine_gpu_decode.py` (offline throughput, decode step, copy bandwidth,
weight bytes). Any of them may be missing when its phase failed or ran out of time;
the record then says so instead of inventing a number.

    python3 benchmarks/serve_h200_report.py --ours O1.json [--ours O2.json] --peer P.json --offline E.json \
        --out benchmarks/results/serve-h200.json [--peer-log LOG] [--note TEXT ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnserve.bench.serve.report import write_all  # noqa: E402

PEER_LABEL = "transformers serve (peer)"
OFFLINE_KEYS = "what copy_bandwidth_TBps weight_bytes_read_per_step ratios errors versions date".split()
OFFLINE_RESULT_KEYS = ("label prefill_backend decode_backend output_tok_per_s decode_step_ms_median "
                       "roofline_step_ms_mean prefill_s ttft_s_median").split()


def _pick(d: dict, keys: list[str]) -> dict:
    return {k: d.get(k) for k in keys}


def _load(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _point(cfg: dict, concurrency: int) -> dict | None:
    return next(
        (p for p in cfg.get("points", []) if p["load"] == "concurrency" and p["value"] == concurrency), None
    )


def _median(cfg: dict | None, concurrency: int, key: str, stat: str | None = None):
    p = _point(cfg, concurrency) if cfg else None
    if p is None or not p["median"].get("completed") and key != "output_tok_s":
        return None
    v = p["median"].get(key)
    return v.get(stat) if stat and isinstance(v, dict) else v


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _target(pair: dict, target: str) -> dict:
    """{measured, reference, ratio = measured / reference, target, met}; met is None when either side
    is missing (a phase did not run), so it is not read as a miss."""
    measured, reference = pair.values()
    r = _ratio(measured, reference)
    op, bound = target.split()
    met = None if r is None else (r >= float(bound) if op == ">=" else r <= float(bound))
    return {**pair, "ratio": r, "target": target, "met": met}


def targets(ours: dict, peer_cfg: dict | None, offline: dict | None) -> list[dict]:
    """One row per configuration of ours: the serving run's four targets, each with its inputs and verdict."""
    off_by_decode = {r["decode_backend"]: r for r in (offline or {}).get("results", [])}
    roofline_ms = None
    if offline and offline.get("copy_bandwidth_TBps"):
        roofline_ms = offline["weight_bytes_read_per_step"] / (offline["copy_bandwidth_TBps"] * 1e12) * 1e3
    rows = []
    for cfg in ours.get("configs", []):
        if cfg.get("error"):
            rows.append({"config": cfg["label"], "error": cfg["error"]})
            continue
        dec = (cfg.get("attention_backend") or {}).get("decode")
        off = off_by_decode.get(dec)
        tok64, tpot64 = _median(cfg, 64, "output_tok_s"), _median(cfg, 64, "tpot_ms", "p50")
        tpot1 = _median(cfg, 1, "tpot_ms", "p50")
        row = {"config": cfg["label"], "decode_backend": dec, "offline_config": off["label"] if off else None}
        off_tok = off["output_tok_per_s"] if off else None
        off_step = off["decode_step_ms_median"] if off else None
        row["c64_output_tok_s_vs_offline"] = _target({"server": tok64, "offline": off_tok}, ">= 0.95")
        step = {"server_ms": tpot64, "offline_step_ms": off_step}
        row["c64_tpot_p50_vs_offline_step"] = _target(step, "<= 1.15")
        itl = {"p99_ms": _median(cfg, 64, "itl_ms", "p99"), "p50_ms": _median(cfg, 64, "itl_ms", "p50")}
        row["c64_itl_p99_vs_p50"] = _target(itl, "<= 3")
        roof = roofline_ms and round(roofline_ms, 3)
        row["c1_tpot_p50_vs_roofline"] = _target({"server_ms": tpot1, "roofline_ms": roof}, "<= 1.3")
        for c in (32, 64):
            pair = {"server": _median(cfg, c, "output_tok_s"), "peer": _median(peer_cfg, c, "output_tok_s")}
            row[f"c{c}_output_tok_s_vs_peer"] = _target(pair, ">= 5")
        rows.append(row)
    return rows


def where_time_goes(rows: list[dict], offline: dict | None, offline_c1: dict | None) -> list[str]:
    """For each missed target, split the gap into engine time (offline, same shapes) and server time."""
    notes = []
    step1 = None
    if offline_c1 and offline_c1.get("results"):
        step1 = offline_c1["results"][0].get("decode_step_ms_median")
    for row in rows:
        if "error" in row:
            continue
        c1, t64, s64 = (
            row["c1_tpot_p50_vs_roofline"],
            row["c64_output_tok_s_vs_offline"],
            row["c64_tpot_p50_vs_offline_step"],
        )
        if c1["met"] is False:
            msg = (
                f"{row['config']}: c=1 TPOT p50 {c1['server_ms']} ms is {c1['ratio']}x the weights-only "
                f"roofline {c1['roofline_ms']} ms"
            )
            if step1:
                msg += (
                    f"; the offline engine's batch-1 decode step (triton, graphs) is {step1} ms = "
                    f"{round(step1 / c1['roofline_ms'], 2)}x roofline (the engine's share), and the "
                    f"server's TPOT is {round(c1['server_ms'] / step1, 2)}x that step (the server's share)"
                )
            notes.append(msg)
        if t64["met"] is False:
            notes.append(
                f"{row['config']}: c=64 output {t64['server']} tok/s is {t64['ratio']}x the offline engine's "
                f"{t64['offline']} tok/s ({row['offline_config']}); TPOT p50 {s64['server_ms']} ms against "
                f"an offline full-batch step of {s64['offline_step_ms']} ms ({s64['ratio']}x): the rest is "
                "time outside the decode step (HTTP, detokenization, streaming, scheduling of arrivals)"
            )
        elif s64["met"] is False:
            notes.append(
                f"{row['config']}: c=64 TPOT p50 {s64['server_ms']} ms is {s64['ratio']}x the offline step "
                f"{s64['offline_step_ms']} ms while throughput met its target: TPOT also counts the steps "
                "that prefill other requests' prompts (all 64 arrive together) after a request's first token"
            )
    return notes


def _targets_markdown(rows: list[dict]) -> str:
    head = (
        "config",
        "c64 out tok/s vs offline (>= 0.95)",
        "c64 TPOT p50 vs offline step (<= 1.15)",
        "c64 ITL p99 vs p50 (<= 3)",
        "c1 TPOT p50 vs roofline (<= 1.3)",
        "c32 vs peer (>= 5)",
        "c64 vs peer (>= 5)",
    )
    lines = ["", "## Targets", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = (
        "c64_output_tok_s_vs_offline",
        "c64_tpot_p50_vs_offline_step",
        "c64_itl_p99_vs_p50",
        "c1_tpot_p50_vs_roofline",
        "c32_output_tok_s_vs_peer",
        "c64_output_tok_s_vs_peer",
    )
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | did not run |" + " |" * (len(keys) - 1))
            continue
        cells = []
        for k in keys:
            t = row[k]
            cells.append(
                "-" if t["ratio"] is None else f"{t['ratio']:.2f}x {'met' if t['met'] else 'MISSED'}"
            )
        lines.append(f"| {row['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def merge_ours(paths: list[Path]) -> dict:
    """Our sweeps as one: the first readable file's dataset/load/command, every file's configurations."""
    found = [(p, _load(p)) for p in paths]
    readable = [d for _, d in found if d is not None]
    ours = dict(readable[0]) if readable else {"title": "attnserve bench serve"}
    ours["configs"] = [c for d in readable for c in d.get("configs", [])]
    ours["notes"] = list(ours.get("notes", [])) + [
        f"{p}: this part of our sweep wrote no JSON" for p, d in found if d is None
    ]
    if len(readable) > 1:
        ours["command"] = " ; ".join(d.get("command", "?") for d in readable)
    return ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ours", type=Path, action="append", required=True, help="our sweeps, in order (repeatable)"
    )
    ap.add_argument("--peer", type=Path)
    ap.add_argument("--offline", type=Path)
    ap.add_argument("--offline-c1", type=Path, help="engine_gpu_decode.py with --requests 1")
    ap.add_argument("--peer-log", type=Path, help="the peer server's log, quoted when the peer did not run")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", action="append", default=[])
    args = ap.parse_args()

    ours = merge_ours(args.ours)
    peer, offline, offline_c1 = _load(args.peer), _load(args.offline), _load(args.offline_c1)
    report = dict(ours)
    ds = ours.get("dataset", {})
    report["title"] = (
        f"{ours.get('gpu', '?')}: Llama-3-8B shape, random bf16 weights, random "
        f"{ds.get('input_len')} in / {ds.get('output_len')} out"
    )
    report["command"] = "OUT=out bash benchmarks/h200.sh serve"
    report["commands"] = {
        "ours": ours.get("command"),
        "peer": (peer or {}).get("command"),
        "offline": (offline or {}).get("command"),
    }
    notes = list(ours.get("notes", [])) + list(args.note)
    peer_cfgs = [c for c in (peer or {}).get("configs", []) if not c.get("error")]
    if peer_cfgs:
        peer_cfg = dict(peer_cfgs[0], label=PEER_LABEL)
        report["peer_load"] = peer.get("load")
    else:
        why = ((peer or {}).get("configs") or [{}])[0].get("error") or "the peer sweep wrote no results"
        why = why.replace("\n", " / ")
        if args.peer_log and args.peer_log.is_file():
            tail = args.peer_log.read_text(errors="replace").strip().splitlines()[-12:]
            why += " | end of the peer's log: " + " / ".join(line.strip() for line in tail)
        peer_cfg = {"label": PEER_LABEL, "error": why[:2000], "points": []}
        notes.append(f"the peer did not run: {why[:2000]}")
    report["configs"] = list(ours.get("configs", [])) + [peer_cfg]
    if offline:
        report["offline"] = _pick(offline, OFFLINE_KEYS)
        report["offline"]["results"] = [_pick(r, OFFLINE_RESULT_KEYS) for r in offline.get("results", [])]
    else:
        notes.append(
            "the offline engine run (benchmarks/engine_gpu_decode.py) wrote no JSON: no offline ratios"
        )
    report["targets"] = targets(ours, peer_cfg if peer_cfgs else None, offline)
    if offline_c1:
        r = (offline_c1.get("results") or [{}])[0]
        report["offline_c1"] = _pick(r, OFFLINE_RESULT_KEYS)
    notes += where_time_goes(report["targets"], offline, offline_c1)
    report["notes"] = notes
    write_all(report, args.out)
    md = args.out.with_suffix(".md")
    md.write_text(md.read_text() + _targets_markdown(report["targets"]))
    print(md.read_text())


if __name__ == "__main__":
    main()
