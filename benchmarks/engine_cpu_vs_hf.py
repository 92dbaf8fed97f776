"""Offline throughput on this CPU: attnserve's engine vs HF transformers `generate`, same model and lengths.

SmolLM2-135M-Instruct (the embedded GGUF, dequantised to fp32 by both), greedy,
the same prompts and exactly --new-tokens output tokens each (EOS ignored by
both), at 1 request at a time and at --concurrency requests at once (transformers
gets them as one left-padded batch). Each measurement is repeated and the best
kept, because the machine is shared. The prefix cache is flushed between runs.

    python benchmarks/engine_cpu_vs_hf.py [--new-tokens 64] [--concurrency 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

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


def run_ours(llm, prompts, new_tokens, concurrency):
    from attnserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.engine.flush_cache()
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += llm.generate(prompts[i : i + concurrency], params)
    secs = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return secs, [o.token_ids for o in outs]


def run_hf(model, tok, prompts, new_tokens, concurrency):
    start = time.perf_counter()
    outs = []
    with torch.inference_mode():
        for i in range(0, len(prompts), concurrency):
            batch = tok(prompts[i : i + concurrency], return_tensors="pt", padding=True)
            gen = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            outs += gen[:, batch["input_ids"].shape[1] :].tolist()
    secs = time.perf_counter() - start
    assert all(len(o) == new_tokens for o in outs)
    return secs, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_cpu_vs_hf.json"))
    args = ap.parse_args()
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnserve.engine.llm import LLM
    from attnserve.models.loader import embedded_model_path

    gguf = embedded_model_path()
    llm = LLM(device="cpu", max_total_tokens=8192)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()

    total_tokens = len(PROMPTS) * args.new_tokens
    results = {}
    for conc in (1, args.concurrency):
        best = {"attnserve": float("inf"), "transformers": float("inf")}
        tokens = {}
        for _ in range(args.repeats):  # interleaved, so background load hits both alike
            s, tokens["attnserve"] = run_ours(llm, PROMPTS, args.new_tokens, conc)
            best["attnserve"] = min(best["attnserve"], s)
            s, tokens["transformers"] = run_hf(hf, tok, PROMPTS, args.new_tokens, conc)
            best["transformers"] = min(best["transformers"], s)
        same16 = sum(a[:16] == b[:16] for a, b in zip(tokens["attnserve"], tokens["transformers"]))
        results[f"concurrency_{conc}"] = {
            "attnserve_s": round(best["attnserve"], 3),
            "transformers_s": round(best["transformers"], 3),
            "attnserve_tok_per_s": round(total_tokens / best["attnserve"], 2),
            "transformers_tok_per_s": round(total_tokens / best["transformers"], 2),
            "speedup": round(best["transformers"] / best["attnserve"], 3),
            "prompts_with_same_first_16_greedy_tokens": f"{same16}/{len(PROMPTS)}",
        }
        print(conc, results[f"concurrency_{conc}"], flush=True)

    import transformers

    report = {
        "what": "offline throughput, SmolLM2-135M-Instruct Q4_1 GGUF dequantised to fp32, greedy, EOS ignored",
        "prompts": len(PROMPTS),
        "new_tokens_per_prompt": args.new_tokens,
        "repeats_best_of": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "engine": {"attention_backend": llm.engine.parts.decode_backend,
                   "chunked_prefill_size": llm.engine.config.chunked_prefill_size},
        "results": results,
        "command": "python benchmarks/engine_cpu_vs_hf.py " + f"--new-tokens {args.new_tokens} "
                   f"--concurrency {args.concurrency} --repeats {args.repeats}",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
