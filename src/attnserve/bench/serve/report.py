"""The sweep's outputs: the JSON record, a Markdown table, and a PNG of latency against throughput.

Every point shows the median over its seeds; failed requests and their reasons are
printed under the table, never folded away. matplotlib is the [bench] extra: without
it the JSON and Markdown are still written and the PNG is skipped with a message.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _ms(dist: dict | None, stat: str) -> str:
    v = (dist or {}).get(stat)
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _load(point: dict) -> str:
    if point["load"] == "concurrency":
        return f"c={int(point['value'])}"
    return "rate=inf" if math.isinf(point["value"]) else f"rate={point['value']:g}/s"


def _backends(cfg: dict) -> str:
    ab = cfg.get("attention_backend")
    if not ab:
        return "-"
    pre, dec = ab.get("prefill"), ab.get("decode")
    return str(pre) if pre == dec else f"{pre} / {dec}"


COLUMNS = (
    "config",
    "backends (prefill / decode)",
    "load",
    "seeds",
    "ok / failed / cut",
    "req/s",
    "out tok/s",
    "TTFT p50 / p99 ms",
    "TPOT p50 / p99 ms",
    "ITL p50 / p99 ms",
    "E2E p50 / p99 ms",
)


def markdown(report: dict) -> str:
    lines = [f"# Serving benchmark: {report.get('title', 'attnserve bench serve')}", ""]
    ds, load = report.get("dataset", {}), report.get("load", {})
    lines += [
        f"- date: {report.get('date')}; GPU: {report.get('gpu')}",
        f"- dataset: {json.dumps(ds)}",
        f"- load: {json.dumps(load)}",
        f"- command: `{report.get('command')}`",
    ]
    for note in report.get("notes", []):
        lines.append(f"- note: {note}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    errors = []
    for cfg in report.get("configs", []):
        if cfg.get("error"):
            reason = cfg["error"].strip().splitlines()[-1].replace("|", "/")  # the server's last word
            state = "stopped" if cfg.get("points") else "did not run"
            lines.append(
                f"| {cfg['label']} | {_backends(cfg)} | {state}: {reason[:160]} |" + " |" * (len(COLUMNS) - 3)
            )
        for p in cfg.get("points", []):
            m = p["median"]
            row = (
                cfg["label"],
                _backends(cfg),
                _load(p),
                str(len(p["seeds"])),
                f"{m['completed']} / {m['failed']} / {m['cut_by_time_budget']}",
                f"{m['request_throughput']:.2f}",
                f"{m['output_tok_s']:.0f}",
                f"{_ms(m['ttft_ms'], 'p50')} / {_ms(m['ttft_ms'], 'p99')}",
                f"{_ms(m['tpot_ms'], 'p50')} / {_ms(m['tpot_ms'], 'p99')}",
                f"{_ms(m['itl_ms'], 'p50')} / {_ms(m['itl_ms'], 'p99')}",
                f"{_ms(m['e2e_ms'], 'p50')} / {_ms(m['e2e_ms'], 'p99')}",
            )
            lines.append("| " + " | ".join(row) + " |")
            kinds = sorted(m["errors"].items(), key=lambda kv: -kv[1])
            errors += [f"- {cfg['label']} {_load(p)}: {n} x {msg}" for msg, n in kinds[:5]]
            if len(kinds) > 5:
                errors.append(
                    f"- {cfg['label']} {_load(p)}: {sum(n for _, n in kinds[5:])} more, "
                    f"{len(kinds) - 5} other messages (all in the JSON)"
                )
    if errors:
        lines += ["", "Failed requests:", *errors]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> str | None:
    """Median TTFT and TPOT (p50) against output tok/s, one curve per configuration and load kind.
    Returns why it was skipped, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'attnserve[bench]'): no PNG"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, cfg in enumerate(report.get("configs", [])):
        for kind, style in (("concurrency", "o-"), ("rate", "s--")):
            pts = [p for p in cfg.get("points", []) if p["load"] == kind and p["median"]["completed"]]
            if not pts:
                continue
            x = [p["median"]["output_tok_s"] for p in pts]
            label = cfg["label"] + ("" if kind == "concurrency" else " (open loop)")
            for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
                y = [p["median"][key]["p50"] for p in pts]
                if all(v is None for v in y):
                    continue
                ax.plot(
                    x, [float("nan") if v is None else v for v in y], style, color=f"C{i % 10}", label=label
                )
                for xi, yi, p in zip(x, y, pts):
                    if yi is not None:
                        ax.annotate(_load(p), (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(report.get("title", "attnserve bench serve"), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_all(
    report: dict, json_path: Path, md_path: Path | None = None, png_path: Path | None = None
) -> list[str]:
    """JSON, Markdown and PNG next to each other (written whole, through a temporary file); returns notes."""
    json_path = Path(json_path)
    md_path = md_path or json_path.with_suffix(".md")
    png_path = png_path or json_path.with_suffix(".png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((json_path, json.dumps(report, indent=1) + "\n"), (md_path, markdown(report))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    skipped = plot(report, png_path)
    return [skipped] if skipped else []
