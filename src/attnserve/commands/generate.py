"""`attnserve generate "prompt"`: run prompts through the engine and stream the text.

With no --model it runs the embedded SmolLM2-135M-Instruct on whatever device is
present. `--prompts-file` submits every line at once (continuous batching);
with `--json` each prompt gives one JSON object, in input order, then a totals line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from attnserve.commands.engine_args import add_engine_arguments, engine_config, run_other_node
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate", help="generate text from prompts with the engine",
        description="Generate text from one prompt or a file of prompts, streaming it as it is produced. "
        "Without --model it runs the embedded SmolLM2-135M-Instruct.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompts-file)")
    p.add_argument("--prompts-file", help="one prompt per line, all submitted at once")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of streaming text")
    p.add_argument("--quiet", action="store_true", help="no start-up log on stderr")
    return p


def _read_prompts(args) -> list[str]:
    if args.prompts_file:
        if args.prompt:
            raise ValueError("give a prompt or --prompts-file, not both")
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts_file} has no prompts (one per line)")
        return prompts
    if args.prompt is None:
        raise ValueError("no prompt: give one as an argument or use --prompts-file FILE")
    return [args.prompt]


def run(args) -> int:
    if args.node_rank != 0:
        if not args.quiet:
            logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        return run_other_node(args)  # node 0 generates; this machine only runs ranks
    prompts = _read_prompts(args)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n,
    )
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    llm = LLM(config=engine_config(args))
    if args.chat:
        prompts_in = [llm.apply_chat_template(p, system=args.system) for p in prompts]
    else:
        prompts_in = prompts

    start = time.perf_counter()
    outputs = []
    streaming = not args.json and len(prompts) == 1 and args.n == 1
    for ev in llm.stream(prompts_in, params):
        if streaming and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        if ev.finished:
            outputs.append(ev.output)
    elapsed = time.perf_counter() - start
    outputs.sort(key=lambda o: (o.index, o.completion))
    for o in outputs:
        o.prompt = prompts[o.index]  # the user's prompt, not the templated text

    if args.json:
        speculating = llm.engine.drafter is not None
        for o in outputs:
            print(json.dumps({**o.to_json(), **(o.spec_json() if speculating else {})}, ensure_ascii=False))
        if args.prompts_file or args.n > 1:
            print(json.dumps({"totals": _totals(llm, outputs, elapsed)}))
    elif streaming:
        sys.stdout.write("\n")
    else:
        for o in outputs:
            print(f"=== prompt {o.index}" + (f" completion {o.completion}" if args.n > 1 else "")
                  + f" ({o.finish_reason}) ===")
            print(o.text)
        print(json.dumps({"totals": _totals(llm, outputs, elapsed)}), file=sys.stderr)
    return 0


def _totals(llm, outputs, elapsed: float) -> dict:
    out_tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    ttfts = [o.ttft_s for o in outputs if o.ttft_s is not None]
    tpots = [o.tpot_s for o in outputs if o.tpot_s is not None]
    return {
        "requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 4),
        "throughput_tok_per_s": round(out_tokens / elapsed, 2) if elapsed > 0 else None,
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 5) if ttfts else None,
        "mean_tpot_s": round(sum(tpots) / len(tpots), 5) if tpots else None,
        "cache_hit_rate": stats["cache"].get("hit_rate", 0.0),
        "cached_tokens": stats["cache"].get("hit_tokens", 0),
        "preemptions": stats["preemptions"],
        "pages_leaked": llm.engine.pages_leaked(),
        "attention_backend": {"prefill": llm.engine.parts.attention.prefill_backend,
                              "decode": llm.engine.parts.attention.decode_backend},
        **({"speculative": stats["speculative"]} if "speculative" in stats else {}),
    }
