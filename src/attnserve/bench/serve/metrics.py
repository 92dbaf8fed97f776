"""What one load point measured: counts, throughputs and latency distributions.

TTFT and ITL include requests cut by the time budget (their first token and the gaps
they streamed are real measurements); TPOT and end-to-end latency are taken over
completed requests only, since a cut request has no end. Percentiles interpolate
linearly between order statistics (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.

Goodput (`--goodput ttft:500 tpot:20 e2el:...`, vLLM's keys, milliseconds): completed
requests per second that met every objective given. A request with a single output token
has no TPOT and meets a TPOT objective.
"""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np

STATS = ("mean", "p50", "p90", "p99")
DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
COUNTS = ("requests_sent", "completed", "failed", "cut_by_time_budget")
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """['ttft:500', 'tpot:20'] -> {'ttft': 500.0, 'tpot': 20.0} (milliseconds); None when not given."""
    if not items:
        return None
    slo = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if key not in SLO_KEYS or not ms > 0:
            raise ValueError(
                f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)} and MS > 0, "
                "e.g. ttft:500 tpot:20"
            )
        slo[key] = ms
    return slo


def meets(result, slo: dict[str, float]) -> bool:
    """A completed request within every objective of `slo` (milliseconds)."""
    if not result.ok:
        return False
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2e_s}
    for key, limit_ms in slo.items():
        value = measured[key]
        if value is None:
            if key != "tpot":  # a one-token answer has no TPOT; no first token is a miss
                return False
        elif value * 1e3 > limit_ms:
            return False
    return True


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (None for an empty list)."""
    if not values_s:
        return {k: None for k in STATS}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean": round(float(ms.mean()), 3),
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
    }


def summarize(results, duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """One point (one seed): the RequestResults it sent and the seconds it took; with `slo`, its goodput."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if r.error is not None]
    cut = [r for r in results if r.cut and r.error is None]
    streamed = done + cut
    out_tokens = sum(r.output_tokens for r in streamed)
    in_tokens = sum(r.prompt_len for r in streamed if r.ttft_s is not None)
    dur = max(duration_s, 1e-9)
    out = {
        "requests_sent": len(results),
        "completed": len(done),
        "failed": len(failed),
        "cut_by_time_budget": len(cut),
        "errors": dict(Counter(r.error for r in failed)),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(done) / dur, 3),
        "input_tok_s": round(in_tokens / dur, 1),
        "output_tok_s": round(out_tokens / dur, 1),
        "total_tok_s": round((in_tokens + out_tokens) / dur, 1),
        "output_tokens_mean": round(out_tokens / len(streamed), 1) if streamed else None,
        "usage_reported": bool(streamed) and all(r.usage_reported for r in done),
        "cached_prompt_fraction": round(
            sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_len for r in done)), 3
        ),
        "ttft_ms": distribution([r.ttft_s for r in streamed if r.ttft_s is not None]),
        "tpot_ms": distribution([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution([gap for r in streamed for gap in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in done]),
    }
    if slo is not None:
        good = sum(meets(r, slo) for r in done)
        out["goodput"] = {
            "request_goodput": round(good / dur, 3),
            "good_requests": good,
            "good_fraction": round(good / len(done), 3) if done else None,
        }
    return out


def engine_activity(before: dict | None, after: dict | None, duration_s: float) -> dict | None:
    """What the engine did during a point, from two /server_info reads around it (attnserve servers report
    `engine_steps`; peers do not, and get None): steps and mean step time by mode, and the fraction of the
    point the engine spent in steps. A busy fraction well under 1 at a load that keeps the engine full means
    time lost outside the engine (HTTP, tokenizing, the wire); near 1, the steps themselves cost the time."""
    b, a = (before or {}).get("engine_steps"), (after or {}).get("engine_steps")
    if not b or not a or duration_s <= 0:
        return None
    out: dict = {}
    busy = 0.0
    for mode in ("decode", "mixed", "extend", "target_verify"):
        steps = a["by_mode"].get(mode, 0) - b["by_mode"].get(mode, 0)
        seconds = a["seconds_by_mode"].get(mode, 0.0) - b["seconds_by_mode"].get(mode, 0.0)
        busy += seconds
        out[f"{mode}_steps"] = steps
        out[f"{mode}_step_ms_mean"] = round(1e3 * seconds / steps, 3) if steps else None
    out["busy_s"] = round(busy, 3)
    out["busy_fraction"] = round(busy / duration_s, 3)
    return out


def _numbers(values: list) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def aggregate_seeds(per_seed: list[dict]) -> tuple[dict, dict]:
    """(median, spread) over the seeds of one point: counts and errors are summed (nothing is dropped),
    every other number is the median across seeds, and spread gives its [min, max]."""
    median: dict = {}
    spread: dict = {}
    for key in per_seed[0]:
        values = [s[key] for s in per_seed]
        if key in COUNTS:
            median[key] = sum(values)
        elif key == "errors":
            total: Counter = Counter()
            for errs in values:
                total.update(errs)
            median[key] = dict(total)
        elif key == "usage_reported":
            median[key] = all(values)
        elif isinstance(values[0], dict):
            median[key], spread[key] = {}, {}
            for stat in values[0]:
                nums = _numbers([v[stat] for v in values])
                median[key][stat] = round(statistics.median(nums), 3) if nums else None
                spread[key][stat] = [min(nums), max(nums)] if nums else None
        else:
            nums = _numbers(values)
            median[key] = round(statistics.median(nums), 3) if nums else None
            spread[key] = [min(nums), max(nums)] if nums else None
    return median, spread
