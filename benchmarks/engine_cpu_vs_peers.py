"""Offline decode throughput on this CPU: attnserve beside transformers `generate` and llama.cpp, same GGUF file.

The embedded SmolLM2-135M-Instruct (Q4_1 GGUF), greedy, the same 8 prompts, exactly --new-tokens
new tokens per prompt (EOS ignored by every side), at 1 request at a time and at 8 at once:

- attnserve: the engine as `attnserve generate` runs it (defaults: bf16 on a CPU with AMX/AVX512-BF16,
  Q4 weights kept 4-bit for 1-2 row steps; --ours-args adds engine settings); 8 requests go in together
  and are continuously batched.
- transformers: `generate` on the same file (dequantised by transformers), in bf16 and in fp32, the faster
  of the two kept per scenario; 8 requests are one left-padded batch, as `generate` is meant to be used.
- llama.cpp through `llama-cpp-python` (optional: `pip install '.[bench]'`, built from source, see the
  README): one `Llama` holds one sequence, so 8 "concurrent" requests run one after the other; the
  8-request figure is that sequential aggregate.

Each side runs in its own process (two OpenMP runtimes in one process spin against each other),
one side after the other, each scenario's best of --repeats kept; the load average is recorded before
and after each side, since the numbers mean little on a busy machine. About 10 minutes on 2 cores (15 with --repeats 3 on a busy machine).

    python benchmarks/engine_cpu_vs_peers.py [--new-tokens 64] [--repeats 2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from attnserve.versions import source_commit

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "List three uses of a paper clip:",
    "Once upon a time, in a small village at the edge of a forest, there lived",
    "What is the difference between a list and a tuple in Python?",
    "Translate to French: The weather is nice today.",
    "Give me a recipe for pancakes.",
]
CONCURRENCY = (1, 8)


def _best(run, repeats: int):
    """(best seconds, outputs of that run) over `repeats` runs of `run() -> (seconds, token lists)`."""
    best = (float("inf"), None)
    for _ in range(repeats):
        secs, toks = run()
        if secs < best[0]:
            best = (secs, toks)
    return best


def side_attnserve(args) -> dict:
    import torch

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    extra = json.loads(args.ours_args or "{}")
    llm = LLM(device="cpu", max_total_tokens=8192, **extra)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up

    def run(conc):
        llm.engine.flush_cache()
        start = time.perf_counter()
        outs = []
        for i in range(0, len(PROMPTS), conc):
            outs += llm.generate(PROMPTS[i : i + conc], params)
        return time.perf_counter() - start, [o.token_ids for o in outs]

    lines = llm.engine.parts.startup_lines
    setting = {**extra, "startup": [line for line in lines if line.startswith(("device:", "weights:", "fused ops:"))]}
    return {str(c): _result(*_best(lambda c=c: run(c), args.repeats), setting) for c in CONCURRENCY}


def side_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnserve.models.loader import embedded_model_path

    torch.set_num_threads(args.threads)
    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    results: dict[str, dict] = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()

        def run(conc, model=model):
            start = time.perf_counter()
            outs = []
            with torch.inference_mode():
                for i in range(0, len(PROMPTS), conc):
                    batch = tok(PROMPTS[i : i + conc], return_tensors="pt", padding=True)
                    gen = model.generate(**batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False, pad_token_id=tok.pad_token_id)
                    outs += gen[:, batch["input_ids"].shape[1] :].tolist()
            return time.perf_counter() - start, outs

        run(1)  # warm-up
        for c in CONCURRENCY:
            res = _result(*_best(lambda c=c: run(c), args.repeats), {"dtype": dtype_name})
            res["tok_per_s_by_dtype"] = {dtype_name: res["tok_per_s"]}
            prev = results.get(str(c))
            if prev is not None:
                res["tok_per_s_by_dtype"].update(prev["tok_per_s_by_dtype"])
            if prev is None or res["tok_per_s"] > prev["tok_per_s"]:
                results[str(c)] = res
            else:
                prev["tok_per_s_by_dtype"] = res["tok_per_s_by_dtype"]
        del model
    return results


def side_llama_cpp(args) -> dict:
    import llama_cpp

    from attnserve.models.loader import embedded_model_path

    llm = llama_cpp.Llama(model_path=str(embedded_model_path()), n_ctx=1024, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)

    def one(prompt: str) -> list[int]:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # never stops by itself: EOS ignored
            out.append(int(token))
            if len(out) == args.new_tokens:
                break
        return out

    def run():
        start = time.perf_counter()
        outs = [one(p) for p in PROMPTS]
        return time.perf_counter() - start, outs

    one(PROMPTS[0])  # warm-up
    secs, toks = _best(run, args.repeats)
    setting = {"weights": "Q4_1 as stored (llama.cpp's own kernels)", "n_threads": args.threads}
    seq = _result(secs, toks, setting)
    eight = dict(seq, mode="sequential: llama-cpp-python's Llama holds one sequence, so the 8 requests run "
                 "one after the other (the aggregate equals the 1-request figure)")
    return {"1": seq, "8": eight}


def _result(secs: float, toks, setting: dict) -> dict:
    n = sum(map(len, toks))
    return {"seconds": round(secs, 3), "tokens": n, "tok_per_s": round(n / secs, 2), "setting": setting,
            "token_ids": toks}


SIDES = {"attnserve": side_attnserve, "transformers": side_transformers, "llama.cpp": side_llama_cpp}




def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "llama_cpp_python", "attnserve"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    commit = source_commit()
    if commit:
        out["attnserve_commit"] = commit
    return out


def _run_side(name: str, args) -> dict:
    """One side in a child process; its JSON comes back on the last stdout line."""
    cmd = [sys.executable, __file__, "--side", name, "--new-tokens", str(args.new_tokens), "--repeats",
           str(args.repeats), "--threads", str(args.threads)]
    if args.ours_args:
        cmd += ["--ours-args", args.ours_args]
    before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail), "load_avg_1min_before": before}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load_avg_1min_before"], out["load_avg_1min_after"] = round(before, 2), round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def _common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean number of leading greedy tokens two sides agree on (bf16/int4 vs dequantised fp32 vs llama.cpp's
    own kernels round differently, so continuations part somewhere; informative, not a check)."""
    lengths = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        lengths.append(n)
    return round(sum(lengths) / max(1, len(lengths)), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every side (default: the CPUs this process may use)")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ", ".join(SIDES))
    ap.add_argument("--ours-args", default=None, help='extra LLM(...) settings as JSON, e.g. {"dtype": "fp32"}')
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_cpu_vs_peers.json"))
    args = ap.parse_args()
    if args.side:  # child: one side, JSON on the last line
        print(json.dumps(SIDES[args.side](args)))
        return

    start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    sides = {name: _run_side(name, args) for name in args.sides.split(",")}
    load_after = [round(x, 2) for x in os.getloadavg()]
    ours = sides.get("attnserve", {})
    summary = {}
    for c in map(str, CONCURRENCY):
        row = {name: side[c]["tok_per_s"] for name, side in sides.items() if c in side}
        if "attnserve" in row:
            for peer in ("transformers", "llama.cpp"):
                if peer in row:
                    row[f"vs_{peer}"] = round(row["attnserve"] / row[peer], 3)
                    row[f"mean_common_prefix_tokens_with_{peer}"] = _common_prefix(ours[c]["token_ids"],
                                                                                   sides[peer][c]["token_ids"])
        summary[c] = row
    for side in sides.values():
        for c in map(str, CONCURRENCY):
            if c in side:
                side[c].pop("token_ids", None)
    from attnserve.hardware import cpu_model_name
    report = {
        "what": (f"offline decode throughput, SmolLM2-135M-Instruct Q4_1 GGUF (the embedded file, for every side), "
                 f"{len(PROMPTS)} prompts x {args.new_tokens} new tokens, greedy, EOS ignored"),
        "summary_tok_per_s": summary,
        "sides": sides,
        "machine": {"cpu": cpu_model_name() or platform.machine(),
                    "cpus_usable": len(os.sched_getaffinity(0)), "threads": args.threads,
                    "load_avg_before": load_before, "load_avg_after": load_after},
        "versions": _versions(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(time.perf_counter() - start, 1),
        "command": " ".join(["python benchmarks/engine_cpu_vs_peers.py", *sys.argv[1:]]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary_tok_per_s"], indent=2))
    print("| requests | attnserve tok/s | transformers tok/s | llama.cpp tok/s | vs transformers | vs llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c, row in summary.items():
        print(f"| {c} | {row.get('attnserve', '-')} | {row.get('transformers', '-')} | {row.get('llama.cpp', '-')} | "
              f"{row.get('vs_transformers', '-')}x | {row.get('vs_llama.cpp', '-')}x |")
    print(f"wrote {args.out} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
