"""The sweep's outputs: the JSON record, a Markdown table, and a PNG of latency against the load.

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
    rate = float(point["value"])  # the JSON keeps an infinite rate as "inf"
    return "rate=inf" if math.isinf(rate) else f"rate={rate:g}/s"


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
    "ITL p50 / p90 / p99 ms",
    "E2E p50 / p99 ms",
)
GOODPUT_COLUMN = "goodput req/s (met SLO)"


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
    slo = load.get("goodput_slo_ms")
    columns = COLUMNS + ((GOODPUT_COLUMN,) if slo else ())
    if slo:
        lines.append("- goodput: completed requests per second within " + ", ".join(
            f"{k} <= {v:g} ms" for k, v in slo.items()))
    lines += ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    errors = []
    for cfg in report.get("configs", []):
        if cfg.get("error"):
            reason = cfg["error"].strip().splitlines()[-1].replace("|", "/")  # the server's last word
            state = "stopped" if cfg.get("points") else "did not run"
            lines.append(
                f"| {cfg['label']} | {_backends(cfg)} | {state}: {reason[:160]} |" + " |" * (len(columns) - 3)
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
                f"{_ms(m['itl_ms'], 'p50')} / {_ms(m['itl_ms'], 'p90')} / {_ms(m['itl_ms'], 'p99')}",
                f"{_ms(m['e2e_ms'], 'p50')} / {_ms(m['e2e_ms'], 'p99')}",
            )
            if slo:
                g = m.get("goodput") or {}
                fraction = g.get("good_fraction")
                share = "-" if fraction is None else f"{fraction:.0%}"
                row += (f"{g.get('request_goodput', 0):.2f} ({share})",)
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


PLOTTED = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))
PERCENTILES = (("p50", "o-"), ("p99", "s--"))


def _x_positions(values: list[float]) -> tuple[list[float], float | None]:
    """x of each load value: finite ones as they are, inf past the largest (returned, for its tick label)."""
    finite = [v for v in values if not math.isinf(v)]
    inf_at = (max(finite) * 1.25 if finite else 1.0) if len(finite) < len(values) else None
    return [inf_at if math.isinf(v) else v for v in values], inf_at


def plot(report: dict, path: Path) -> str | None:
    """TTFT, TPOT and ITL percentiles (p50 solid, p99 dashed) against the request rate (open loop) and the
    concurrency (closed loop), one row per load kind and one line colour per configuration.
    Returns why it was skipped, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogFormatter
    except ImportError:
        return "matplotlib is not installed (pip install 'attnserve[bench]'): no PNG"
    configs = report.get("configs", [])
    present = {p["load"] for c in configs for p in c.get("points", [])}
    kinds = [k for k in ("rate", "concurrency") if k in present] or ["concurrency"]
    fig, axes = plt.subplots(len(kinds), len(PLOTTED), figsize=(15, 4.2 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        inf_ticks = set()
        for i, cfg in enumerate(configs):
            pts = [p for p in cfg.get("points", []) if p["load"] == kind and p["median"]["completed"]]
            if not pts:
                continue
            x, inf_at = _x_positions([float(p["value"]) for p in pts])
            if inf_at is not None:
                inf_ticks.add(inf_at)
            for ax, (key, _) in zip(row, PLOTTED):
                for stat, style in PERCENTILES:
                    y = [p["median"][key][stat] for p in pts]
                    if all(v is None for v in y):
                        continue
                    y = [float("nan") if v is None else v for v in y]
                    ax.plot(x, y, style, color=f"C{i % 10}", label=f"{cfg['label']} {stat}")
        for ax, (_, name) in zip(row, PLOTTED):
            ax.set_xlabel("request rate (req/s)" if kind == "rate" else "concurrency (clients)")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
            ax.grid(True, which="both", alpha=0.3)
            for at in inf_ticks:
                ax.annotate("inf", (at, 0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                            textcoords="offset points", ha="center", fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(report.get("title", "attnserve bench serve"), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
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
