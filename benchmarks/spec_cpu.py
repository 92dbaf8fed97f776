"""Speculative decoding (n-gram drafts) on the CPU: the embedded SmolLM2-135M with and without it.

Input-grounded prompts (repeat code with a variable renamed, a summary that quotes its text) are
where prompt lookup pays; open-ended prompts (nothing to copy) show what it costs when its drafts
fail. Greedy, each prompt wrapped in the chat template, up to --new-tokens tokens (EOS stops).
Both engines run in this process one after the other, best of --repeats per case.

    python benchmarks/spec_cpu.py [--out benchmarks/results/spec-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

CODE = '''def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    discount = 0
    if subtotal > 100:
        discount = subtotal * 0.05
    return (subtotal - discount) * (1 + tax)
'''
TEXT = ("The river Arno flows through Florence. In 1966 it flooded the city, damaging thousands of "
        "paintings and books. Volunteers, later called the Mud Angels, came from all over the world to "
        "rescue the manuscripts from the mud. Restoration work on some of the damaged art continues today.")
GROUNDED = [
    f"Repeat this code exactly, with the variable subtotal renamed to running_total:\n\n{CODE}",
    f"Rewrite this function with the variable discount renamed to rebate. Output only the code.\n\n{CODE}",
    f"Summarize this text, quoting its sentences word for word:\n\n{TEXT}",
    f"Copy this text and then add one sentence at the end:\n\n{TEXT}",
]
OPEN = ["Write a short poem about the sea.", "Give three ideas for a birthday party.",
        "Why is the sky blue? Answer briefly.", "Invent a name for a cat and explain it."]


def _versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version(), "torch": version("torch")}
    try:
        out["attnserve_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                 text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(llm, prompts: list[str], concurrency: int, new_tokens: int, repeats: int) -> dict:
    from attnserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    chats = [llm.apply_chat_template(p) for p in prompts]
    batch = (chats * (concurrency // len(chats) + 1))[:concurrency] if concurrency > 1 else chats
    best = None
    for _ in range(repeats):
        llm.engine.flush_cache()
        before = dict(llm.engine.spec_stats.as_dict())
        start = time.perf_counter()
        if concurrency == 1:
            outs = [o for p in batch for o in llm.generate(p, params)]
        else:
            outs = llm.generate(batch, params)
        secs = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        after = llm.engine.spec_stats.as_dict()
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        run = {"tok_per_s": round(tokens / secs, 2), "output_tokens": tokens, "seconds": round(secs, 3),
               "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
               "verify_steps": after["verify_steps"] - before["verify_steps"],
               "token_ids": [o.token_ids for o in outs]}
        if best is None or run["tok_per_s"] > best["tok_per_s"]:
            best = run
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/spec-cpu.json")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=4)
    args = ap.parse_args()

    import torch

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    engines = {
        "off": LLM(device="cpu", max_total_tokens=16384),
        "ngram": LLM(device="cpu", max_total_tokens=16384, speculative_algorithm="ngram",
                     speculative_num_draft_tokens=args.draft_tokens),
    }
    for llm in engines.values():
        llm.generate(GROUNDED[:2], SamplingParams(max_new_tokens=8))  # warm-up
    cases = [("input-grounded", GROUNDED, 1), ("input-grounded", GROUNDED, 8), ("open-ended", OPEN, 1),
             ("open-ended", OPEN, 8)]
    results = []
    for workload, prompts, conc in cases:
        row = {"workload": workload, "requests": conc}
        for name, llm in engines.items():
            try:
                row[name] = measure(llm, prompts, conc, args.new_tokens, args.repeats)
            except Exception as exc:  # noqa: BLE001 - record the failure, measure the rest
                row[name] = {"error": repr(exc)}
        off, on = row["off"], row["ngram"]
        if "tok_per_s" in off and "tok_per_s" in on:
            row["speedup"] = round(on["tok_per_s"] / off["tok_per_s"], 3)
            row["same_tokens"] = off["token_ids"] == on["token_ids"]
        for side in ("off", "ngram"):
            row[side].pop("token_ids", None)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "benchmark": "speculative decoding (ngram) vs none, embedded SmolLM2-135M GGUF on the CPU",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": _cpu(), "threads": args.threads, "load_average_before": round(load_before, 2),
                    "load_average_after": round(os.getloadavg()[0], 2)},
        "versions": _versions(),
        "settings": {"new_tokens": args.new_tokens, "greedy": True, "chat_template": True,
                     "speculative_num_draft_tokens": args.draft_tokens, "repeats": args.repeats,
                     "startup_ngram": [line for line in engines["ngram"].engine.parts.startup_lines
                                       if line.startswith(("device:", "weights:", "speculative"))]},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
