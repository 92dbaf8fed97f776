"""Speculative decoding (n-gram drafts) on the CPU: the embedded SmolLM2-135M with and without it.

Input-grounded prompts (repeat code with a variable renamed, a summary that quotes its text) are
where prompt lookup pays; open-ended prompts (nothing to copy) show what it costs when its drafts
fail; a drafter forced wrong shows what the give-up rule leaves of their cost. Greedy unless stated,
up to --new-tokens tokens (EOS stops). The engines run in this process one after the other, best of
--repeats per case; tok/s counts prompt processing too (time from submission to the last token).

    python benchmarks/spec_cpu.py [--out benchmarks/results/spec-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from attnserve.versions import source_commit

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
# completion-style (the embedded 135M model copies far more faithfully from a continuation than from a chat turn)
GROUNDED = [
    f"```python\n{CODE}```\n\nThe same function with the variable subtotal renamed to running_total:\n\n```python\n",
    f"```python\n{CODE}```\n\nThe same function with the variable discount renamed to rebate:\n\n```python\n",
    f"{TEXT}\n\nA summary of the text above, quoting it word for word: \"",
    f"Text: {TEXT}\n\nThe text again, copied exactly: ",
]
OPEN = ["Write a short poem about the sea.\n\n", "Three ideas for a birthday party:\n1.",
        "Why is the sky blue? The answer is", "A good name for a cat is"]


class WrongDrafter:
    """The n-gram drafter's proposals with every token shifted by one: nothing is ever accepted, so the
    run shows what failed drafts cost once the drafter gives up on them."""

    def __init__(self, inner, vocab: int):
        self.inner, self.vocab = inner, vocab

    def propose(self, req):
        from attnserve.engine.speculative import DraftTree

        tree = self.inner.propose(req)
        if tree is None:
            return None
        return DraftTree(tuple((t + 1) % self.vocab for t in tree.tokens), tree.parents)

    def observe(self, req, tree, accepted):
        self.inner.observe(req, tree, accepted)

    def forget(self, rid):
        self.inner.forget(rid)


def _versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version(), "torch": version("torch")}
    commit = source_commit()
    if commit:
        out["attnserve_commit"] = commit
    return out




def measure(llm, prompts: list[str], concurrency: int, new_tokens: int, repeats: int, temperature: float) -> dict:
    from attnserve.engine.sampling_params import SamplingParams

    batch = (prompts * (concurrency // len(prompts) + 1))[:concurrency] if concurrency > 1 else prompts
    best = None
    for _ in range(repeats):
        llm.engine.flush_cache()
        before = dict(llm.engine.spec_stats.as_dict())
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i)
                  for i in range(len(batch))]
        start = time.perf_counter()
        if concurrency == 1:
            outs = [o for p, sp in zip(batch, params) for o in llm.generate(p, sp)]
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
    ap.add_argument("--draft-tokens", default="4,8", help="speculative_num_draft_tokens values, comma-separated")
    args = ap.parse_args()

    import torch

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    ks = [int(k) for k in args.draft_tokens.split(",")]
    engines = {"off": LLM(device="cpu", max_total_tokens=16384)}
    for k in ks:
        engines[f"ngram_k{k}"] = LLM(device="cpu", max_total_tokens=16384, speculative_algorithm="ngram",
                                     speculative_num_draft_tokens=k)
    for llm in engines.values():
        llm.generate(GROUNDED[:2], SamplingParams(max_new_tokens=8))  # warm-up
    # (workload, prompts, requests, temperature, speculating sides' drafter: None = their n-gram one)
    cases = [("input-grounded", GROUNDED, 1, 0.0, None), ("input-grounded", GROUNDED, 8, 0.0, None),
             ("open-ended", OPEN, 1, 0.0, None), ("open-ended", OPEN, 8, 0.0, None),
             ("open-ended sampled (temperature 1)", OPEN, 1, 1.0, None),
             ("nothing accepted (drafts forced wrong)", GROUNDED, 1, 0.0, "wrong")]
    results = []
    for workload, prompts, conc, temp, drafter in cases:
        row = {"workload": workload, "requests": conc, "temperature": temp}
        for name, llm in engines.items():
            own = llm.engine.drafter
            if drafter == "wrong" and own is not None:
                llm.engine.drafter = WrongDrafter(own, llm.engine.vocab_size)
            try:
                row[name] = measure(llm, prompts, conc, args.new_tokens, args.repeats, temp)
            except Exception as exc:  # noqa: BLE001 - record the failure, measure the rest
                row[name] = {"error": repr(exc)}
            finally:
                llm.engine.drafter = own
        off = row["off"]
        for k in ks:
            on = row[f"ngram_k{k}"]
            if "tok_per_s" in off and "tok_per_s" in on:
                on["speedup"] = round(on["tok_per_s"] / off["tok_per_s"], 3)
                on["same_tokens_as_off"] = off["token_ids"] == on["token_ids"]
        for name in engines:
            row[name].pop("token_ids", None)
        results.append(row)
        print(json.dumps(row), flush=True)
    from attnserve.hardware import cpu_model_name
    report = {
        "benchmark": "speculative decoding (ngram) vs none, embedded SmolLM2-135M GGUF on the CPU",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model_name() or platform.machine(),
                    "threads": args.threads, "load_average_before": round(load_before, 2),
                    "load_average_after": round(os.getloadavg()[0], 2)},
        "versions": _versions(),
        "settings": {"new_tokens": args.new_tokens, "eos_stops": True, "repeats": args.repeats,
                     "speculative_num_draft_tokens": ks,
                     "startup": [line for line in engines[f"ngram_k{ks[0]}"].engine.parts.startup_lines
                                 if line.startswith(("device:", "weights:", "speculative"))]},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
