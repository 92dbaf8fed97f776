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


def add_parser(sub) -> argparse.ArgumentParser:
    from attnserve.attention.registry import REGISTRY

    backends = ", ".join(sorted(name for name, spec in REGISTRY.items() if spec.implemented))
    p = sub.add_parser(
        "generate", help="generate text from prompts with the engine",
        description="Generate text from one prompt or a file of prompts, streaming it as it is produced. "
        "Without --model it runs the embedded SmolLM2-135M-Instruct.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompts-file)")
    p.add_argument("--prompts-file", help="one prompt per line, all submitted at once")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model directory, .gguf file, or (with --random-weights) a preset; default: embedded SmolLM2")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel size; only 1 (one device) is supported for now")
    p.add_argument("--random-weights", action="store_true", help="random weights of the model's shape (benchmarks)")
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
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help=f"attention backend for prefill and decode (default: chosen for this machine and model; "
                   f"see `attnserve select`); one of: {backends}")
    p.add_argument("--prefill-attention-backend", default=None, metavar="NAME",
                   help="attention backend for prefill only (same names)")
    p.add_argument("--decode-attention-backend", default=None, metavar="NAME",
                   help="attention backend for decode only (same names)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda[:N] or mps")
    p.add_argument("--dtype", default="auto",
                   help="model dtype: auto (fp32 on cpu, else the checkpoint's, bf16 if unstated), bf16, fp16, fp32")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype: auto (the model dtype), bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: 1, or what the chosen backend needs)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="most requests decoding at once (default: 64)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="GPU: fraction of device memory for weights plus the KV pool (default: 0.85)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="prefill tokens per step when chunking is off (default: 16384; one prompt may exceed it)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="<= 0 turns chunking off")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-fused-ops", action="store_true",
                   help="run the unfused torch ops (RMSNorm, SiLU x up, RoPE, K/V store) on the GPU too")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
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
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    if args.tp_size != 1:
        raise ValueError(f"--tp-size {args.tp_size}: tensor parallelism is not supported yet; use --tp-size 1")
    prompts = _read_prompts(args)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n,
    )
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    llm = LLM(
        model=args.model, attention_backend=args.attention_backend,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend, device=args.device, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
        max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, max_context_len=args.context_length,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        disable_radix_cache=args.disable_radix_cache,
        disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_fused_ops=args.disable_fused_ops,
        random_weights=args.random_weights,
    )
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
        for o in outputs:
            print(json.dumps(o.to_json(), ensure_ascii=False))
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
        "attention_backend": {"prefill": llm.engine.parts.prefill_backend,
                              "decode": llm.engine.parts.decode_backend},
    }
