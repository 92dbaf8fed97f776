"""`attnserve bench serve`: the same load at several concurrencies/rates against one or more servers.

Each configuration (a running server given by --url, or `attnserve serve` launched with
--launch / --backends / --compare) gets warm-up requests that are not counted, then
every load point for every seed. After each configuration the JSON, Markdown and PNG
are rewritten, so an interrupted sweep keeps what it measured. See metrics.py for
what each number means.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from attnserve.bench.serve.args import add_arguments  # noqa: F401 - `attnserve bench` builds the parser from it
from attnserve.bench.serve.client import ENDPOINTS, RequestSpec
from attnserve.bench.serve.datasets import (
    SHAREGPT_INPUT_MEAN,
    SHAREGPT_MAX_INPUT,
    SHAREGPT_MAX_TOTAL,
    SHAREGPT_MIN_LEN,
    SHAREGPT_OUTPUT_MEAN,
    SHAREGPT_SIGMA,
)
from attnserve.bench.serve.launch import LaunchedServer, get_json
from attnserve.bench.serve.load import run_point, warm_up
from attnserve.bench.serve.metrics import aggregate_seeds, engine_activity, parse_goodput, summarize
from attnserve.bench.serve.plan import ServerConfig, load_points, server_configs
from attnserve.bench.serve.prompts import Requests, tokenizer_path
from attnserve.bench.serve.report import markdown, write_all


def _gpu_name() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return f"none ({platform.processor() or platform.machine()} CPU)"


def _versions() -> dict:
    """The client side's versions (the server's come from its /server_info)."""
    import importlib.metadata as md

    found = {(d.metadata["Name"] or "").lower(): d.version for d in md.distributions()}
    return {
        "python": sys.version.split()[0],
        **{p: found[p] for p in ("attnserve", "aiohttp", "torch") if p in found},
    }


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disable, leave=False)


def _sweep(
    cfg: ServerConfig, url: str, args, plan, requests: Requests, extra: dict, slo: dict | None, out: dict
) -> None:
    """Fill `out` as points finish, so an interrupted sweep still reports the points it measured."""
    info = get_json(url + "/server_info", args.api_key)
    model = args.model_name
    if model is None:
        models = get_json(url + "/v1/models", args.api_key) or {}
        ids = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
        model = ids[0] if ids else None
    spec = RequestSpec(url, model, args.endpoint, args.ignore_eos, extra, args.api_key)
    out.update(model=model, server_info=info, attention_backend=(info or {}).get("attention_backend"))
    warm = asyncio.run(
        warm_up(spec, requests.get(10_000 + args.seed, args.warmup_requests), args.warmup_requests)
    )
    out["warmup"] = {"requests": len(warm), "failed": sum(1 for r in warm if not r.ok)}
    points = out["points"]
    for planned in plan:
        per_seed = []
        for seed in planned.seeds:
            reqs = requests.get(seed, planned.num_prompts)
            desc = f"{cfg.label} {planned.load.label} seed {seed}"
            before = get_json(url + "/server_info", args.api_key)
            with _progress(len(reqs), desc, args.no_progress) as bar:
                results, duration = asyncio.run(
                    run_point(
                        spec,
                        reqs,
                        planned.load,
                        seed,
                        args.max_point_seconds,
                        on_done=lambda _r: bar.update(1),
                        burstiness=args.burstiness,
                    )
                )
            s = summarize(results, duration, slo)
            engine = engine_activity(before, get_json(url + "/server_info", args.api_key), duration)
            if engine is not None:
                s["engine"] = engine
            s["seed"] = seed
            per_seed.append(s)
            print(
                f"  {desc}: {s['completed']} ok, {s['failed']} failed, {s['cut_by_time_budget']} cut, "
                f"{s['output_tok_s']:.0f} out tok/s, TPOT p50 {s['tpot_ms']['p50']} ms",
                file=sys.stderr,
            )
        median, spread = aggregate_seeds(per_seed)
        median.pop("seed", None)
        spread.pop("seed", None)
        value = "inf" if math.isinf(planned.load.value) else planned.load.value
        points.append(
            {
                "load": planned.load.kind,
                "value": value,
                "seeds": list(planned.seeds),
                "num_prompts": planned.num_prompts,
                "median": median,
                "spread": spread,
                "per_seed": per_seed,
            }
        )
        tpot = median["tpot_ms"]["p50"]
        print(f"  => {cfg.label} {planned.load.label}: median of {len(per_seed)} seed(s) "
              f"{median['output_tok_s']:.0f} out tok/s, TPOT p50 {tpot} ms", file=sys.stderr)


def _run_config(
    cfg: ServerConfig, args, plan, requests: Requests, extra: dict, slo: dict | None, log_dir: Path, out: dict
) -> None:
    if cfg.url is not None:
        _sweep(cfg, cfg.url, args, plan, requests, extra, slo, out)
        return
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in cfg.label)[:60]
    print(f"launching attnserve serve {cfg.flags}  (log: {log_dir / (safe + '.log')})", file=sys.stderr)
    server = LaunchedServer(cfg.flags, log_dir / f"{safe}.log", args.launch_timeout)
    out["server_command"] = shlex.join(["attnserve", *server.command[3:-4]])
    with server:
        _sweep(cfg, server.url, args, plan, requests, extra, slo, out)
    out["server_exit_code"] = server.proc.returncode


def _dataset_details(args) -> dict:
    """What the dataset's prompts and lengths depend on, for the record."""
    if args.dataset == "jsonl":
        return {"path": str(args.dataset_path)}
    if args.dataset == "random":
        return {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio}
    if args.dataset == "generated-shared-prefix":
        return {
            "output_len": args.output_len,
            "sp_groups": args.sp_groups,
            "sp_system_len": args.sp_system_len,
            "sp_question_len": args.sp_question_len,
        }
    if args.dataset == "sharegpt-synthetic":
        return {
            "lognormal_input_mean": SHAREGPT_INPUT_MEAN,
            "lognormal_output_mean": SHAREGPT_OUTPUT_MEAN,
            "lognormal_sigma": SHAREGPT_SIGMA,
            "bounds": f"{SHAREGPT_MIN_LEN} <= tokens, input <= {SHAREGPT_MAX_INPUT}, "
            f"input + output <= {SHAREGPT_MAX_TOTAL}",
        }
    return {}


def _interrupt_on_sigterm() -> None:
    """SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C: launched servers are stopped, results written."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def run(args) -> int:
    configs = server_configs(args.url, args.launch, args.backends, args.compare)
    concurrency = args.concurrency if (args.concurrency or args.request_rate) else "1,8,32,64"
    plan = load_points(concurrency, args.request_rate, args.seeds, args.seed, args.num_prompts)
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests {args.warmup_requests}: must be >= 0")
    if args.max_point_seconds is not None and not args.max_point_seconds > 0:
        raise ValueError(f"--max-point-seconds {args.max_point_seconds}: must be > 0")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness {args.burstiness}: must be > 0")
    slo = parse_goodput(args.goodput)
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body {args.extra_body!r}: not JSON ({exc})") from exc
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body {args.extra_body!r}: must be a JSON object")
    requests = Requests(
        args, tokenizer_path(args, configs) if args.dataset != "jsonl" or args.tokenizer else None
    )
    log_dir = args.server_log_dir or Path(tempfile.mkdtemp(prefix="attnserve-bench-serve-"))
    argv = getattr(args, "_argv", None) or sys.argv[1:]
    report = {
        "title": args.title or "attnserve bench serve",
        "command": shlex.join(["attnserve", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": _gpu_name(),
        "client_versions": _versions(),
        "dataset": {"name": args.dataset, **_dataset_details(args)},
        "load": {
            "points": [p.load.label for p in plan],
            "seeds": {p.load.label: len(p.seeds) for p in plan},
            "num_prompts": {p.load.label: p.num_prompts for p in plan},
            "warmup_requests": args.warmup_requests,
            "max_point_seconds": args.max_point_seconds,
            "burstiness": args.burstiness,
            "goodput_slo_ms": slo,
            "ignore_eos": args.ignore_eos,
            "endpoint": ENDPOINTS[args.endpoint],
            "extra_body": extra,
        },
        "notes": list(args.note),
        "configs": [],
    }
    failed_configs, interrupted = 0, False
    _interrupt_on_sigterm()
    for cfg in configs:
        result = {"label": cfg.label, "url": cfg.url, "flags": cfg.flags, "error": None, "points": []}
        report["configs"].append(result)
        try:
            _run_config(cfg, args, plan, requests, extra, slo, log_dir, result)
        except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
            failed_configs += 1
            print(f"attnserve bench serve: configuration {cfg.label!r} did not run: {exc}", file=sys.stderr)
            result["error"] = str(exc)
        except KeyboardInterrupt:
            interrupted = True
            result["error"] = f"interrupted after {len(result['points'])} of {len(plan)} load points"
        report["notes_written"] = write_all(report, args.json)
        if interrupted:
            break
    print(markdown(report))
    for note in report.get("notes_written", []):
        print(note, file=sys.stderr)
    print(f"wrote {args.json} (+ .md, .png)", file=sys.stderr)
    if interrupted:
        print(
            "attnserve bench serve: interrupted; the points measured so far are in the report",
            file=sys.stderr,
        )
        return 130
    return 1 if failed_configs else 0
