"""Speculative decoding on one GPU: what a verify step costs, and what forced-correct drafts give at batch 1.

A Llama-3-8B-shaped model with random bf16 weights (random weights make meaningless drafts, so acceptance is
forced rather than measured on text):

(a) verify cost: requests holding --context tokens of KV; per batch size, a plain decode step (its CUDA graph)
    against a verify step of q = 1 + K tokens a request (its verify graph, chain; K = 4 also as a tree, and
    again on the prefill tiles instead of the verify step's GQA-packed ones), and the same verify step eager.
    ms per step = wall time of --iters back-to-back replays (host planning included) / iters; ratio = verify
    / decode of the same batch in the same run.
(b) forced acceptance: one request decodes --accept-output tokens greedily without speculation (its tokens
    are recorded), then again on an engine with `speculative_algorithm="ngram"` whose drafter proposes the
    next K tokens of the recorded continuation, each replaced by a wrong token with probability
    --corrupt (0 = every draft right). Decode tok/s of both (first token to last), the ratio, the measured
    acceptance, and whether the outputs match. For (b) the layers' output projections are scaled down
    (--output-scale, TokenDrivenWeights) so that greedy tokens follow the input token: with fully random
    weights the verify kernels' rounding flips near-tied argmaxes and no copied draft survives.

(a) runs on triton, then (b), then (a) again on FlashInfer when it is importable (chains only: its trees verify
eagerly). Every case runs in its own try block; the JSON is written after every part, whatever fails.

    PYTHONPATH=src python3 benchmarks/spec_h200.py --out benchmarks/results/spec-h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import traceback
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, iters: int, device, warmup: int = 3) -> float:
    """Wall ms per call of `iters` back-to-back calls (the device drained before and after)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return round((time.perf_counter() - start) * 1e3 / iters, 3)


def chain_tree_mask(bs: int, q: int, device) -> torch.Tensor:
    """bool `[bs, q, q]` of a two-branch tree: the root, then two chains of the drafts hanging from it."""
    mask = torch.zeros(q, q, dtype=torch.bool)
    parents = [-1] + [0 if i <= 2 else i - 2 for i in range(1, q)]  # 1 and 2 under the root, then alternating
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask.expand(bs, q, q).contiguous().to(device)


def fill_kv(pool, slots: torch.Tensor) -> None:
    """Random K/V at these slots of every layer, so that attention reads real numbers."""
    g = torch.Generator(device=pool.device).manual_seed(0)
    for layer in range(len(pool.k_buffer)):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf[slots] = torch.randn(slots.numel(), *buf.shape[1:], generator=g, device=pool.device,
                                     dtype=torch.float32).to(buf.dtype)


# ---- (a) the verify step's cost ---------------------------------------------------------------------------
def verify_cost(loaded, backend_name: str, args) -> dict:
    from attnserve.attention.layer import attention_step
    from attnserve.batch import ForwardBatch, ForwardMode
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine

    batches, drafts, ctx, device = args.batches, args.draft_tokens, args.context, args.device
    max_bs, max_q = max(batches), 1 + max(drafts)
    cfg = EngineConfig(device=device, dtype=args.dtype, attention_backend=backend_name, max_running_requests=max_bs,
                       cuda_graph_max_bs=max_bs, max_total_tokens=max_bs * (ctx + max_q + 16) + 1024,
                       disable_radix_cache=True)
    engine = Engine(cfg, loaded=loaded)
    out = {"backend": backend_name, "context": ctx, "cases": [], "errors": {}}
    try:
        parts = engine.parts
        runner = parts.graphs.runner
        if runner is None:
            raise RuntimeError(f"no CUDA graphs: {parts.graphs.note}")
        kv, backend, model = parts.kv, parts.backend, parts.model.module
        pool, req_to_token = kv.pool, kv.req_pool.req_to_token
        width = ctx + max_q
        rows, slots = [], []
        for _ in range(max_bs):  # every request holds ctx tokens of KV and room for max_q more
            row = kv.req_pool.alloc()
            s = pool.slots_of_pages(kv.allocator.alloc(-(-width // pool.page_size)))[:width].to(device)
            req_to_token[row, :width] = s.to(torch.int32)
            rows.append(row)
            slots.append(s)
        slots_t = torch.stack(slots)  # [max_bs, width]
        fill_kv(pool, slots_t[:, :ctx].reshape(-1))
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        vocab = loaded.config.vocab_size
        trees = [False] + ([True] if 4 in drafts else [])
        capture = {}
        for k in drafts:
            for tree in trees if k == 4 else [False]:
                try:
                    capture[f"K={k}{' tree' if tree else ''}"] = round(runner.capture_verify(1 + k, tree, batches), 2)
                except Exception as exc:  # noqa: BLE001 - the eager numbers are still worth having
                    out["errors"][f"capture K={k} tree={tree}"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
        out["capture_s"] = capture
        g = torch.Generator(device="cpu").manual_seed(0)
        for bs in batches:
            case = {"batch": bs}
            try:
                ids = torch.randint(0, vocab, (bs,), generator=g).to(device)
                pos = torch.full((bs,), ctx, dtype=torch.int64, device=device)
                loc = slots_t[:bs, ctx].long()
                seq = torch.full((bs,), ctx + 1, dtype=torch.int32, device=device)
                case["decode_ms"] = time_ms(
                    partial(runner.replay, ids, pos, loc, rows_t[:bs], seq, [ctx + 1] * bs), args.iters, device)
            except Exception as exc:  # noqa: BLE001
                out["errors"][f"decode bs={bs}"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            for k in drafts:
                q = 1 + k
                ids = torch.randint(0, vocab, (bs * q,), generator=g).to(device)
                pos = (ctx + torch.arange(q, device=device)).repeat(bs)  # [bs * q]
                loc = slots_t[:bs, ctx : ctx + q].reshape(-1).long()  # [bs * q]
                seq = torch.full((bs,), ctx + q, dtype=torch.int32, device=device)
                for tree in trees if k == 4 else [False]:
                    name = f"K={k}{' tree' if tree else ''}"
                    mask = chain_tree_mask(bs, q, device) if tree else None
                    try:
                        if runner.can_run(bs, q, tree):
                            ms = time_ms(partial(runner.replay, ids, pos, loc, rows_t[:bs], seq,
                                                 [ctx + q] * bs, q, mask), args.iters, device)
                            case[f"verify_ms {name}"] = ms
                            if case.get("decode_ms"):
                                case[f"ratio {name}"] = round(ms / case["decode_ms"], 3)
                    except Exception as exc:  # noqa: BLE001
                        out["errors"][f"verify bs={bs} {name}"] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
                try:  # the eager verify step: plan() and the model, no graph (a chain)
                    fb = ForwardBatch(
                        mode=ForwardMode.TARGET_VERIFY, req_pool_indices=rows_t[:bs], seq_lens=seq,
                        extend_lens=torch.full((bs,), q, dtype=torch.int32, device=device), positions=pos,
                        out_cache_loc=loc, req_to_token=req_to_token, pool=pool,
                        seq_lens_cpu=[ctx + q] * bs, extend_lens_cpu=[q] * bs)

                    def eager(fb=fb, ids=ids, pos=pos):
                        with torch.inference_mode(), attention_step(backend, backend.plan(fb)):
                            return model(ids, pos, fb)

                    case[f"eager_verify_ms K={k}"] = time_ms(eager, max(3, args.iters // 3), device)
                    if runner.can_run(bs, q, False):  # the graph computes what the eager step does
                        ref = eager().clone()
                        got = runner.replay(ids, pos, loc, rows_t[:bs], seq, [ctx + q] * bs, q, None)
                        case[f"graph_vs_eager K={k}"] = {
                            "max_abs_diff": round(float((got - ref).abs().max()), 4),
                            "logit_scale": round(float(ref.abs().max()), 2),
                            "same_argmax": round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4)}
                except Exception as exc:  # noqa: BLE001
                    out["errors"][f"eager verify bs={bs} K={k}"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
        if args.prefill_tiles and 4 in drafts and hasattr(backend, "extend_config"):
            prefill_tiles(runner, backend, out, slots_t, rows_t, args)
    finally:
        engine.close()
        del engine
        _free(device == "cuda")
    return out


def prefill_tiles(runner, backend, out: dict, slots_t, rows_t, args) -> None:
    """K = 4 again on the architecture's prefill tiles (one 128-row tile a query head) instead of the verify
    step's GQA-packed ones sized to its tokens: what the packing saves."""
    from attnserve.attention.kernels.mha.extend import default_extend_config

    ctx, device, q = args.context, args.device, 5
    try:
        backend.extend_config = default_extend_config(backend.pool.head_dim, backend.pool.device)
        runner.capture_verify(q, False, args.batches)
        for case in out["cases"]:
            bs = case["batch"]
            ids = torch.zeros(bs * q, dtype=torch.int64, device=device)
            pos = (ctx + torch.arange(q, device=device)).repeat(bs)
            loc = slots_t[:bs, ctx : ctx + q].reshape(-1).long()
            seq = torch.full((bs,), ctx + q, dtype=torch.int32, device=device)
            ms = time_ms(partial(runner.replay, ids, pos, loc, rows_t[:bs], seq, [ctx + q] * bs, q, None),
                         args.iters, device)
            case["verify_ms K=4 prefill-tiles"] = ms
            if case.get("decode_ms"):
                case["ratio K=4 prefill-tiles"] = round(ms / case["decode_ms"], 3)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["K=4 prefill tiles"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        backend.extend_config = None


# ---- (b) forced acceptance ----------------------------------------------------------------------------
class ForcedDrafter:
    """Proposes the next K tokens of a recorded greedy continuation, each corrupted with probability p."""

    def __init__(self, continuations: dict, k: int, corrupt: float, vocab: int, seed: int = 0):
        from attnserve.engine.speculative.draft_tree import DraftTree

        self.tree_type = DraftTree
        self.continuations, self.k, self.corrupt, self.vocab = continuations, k, corrupt, vocab
        self.rng = random.Random(seed)
        self.proposed_steps = 0
        self.proposed_tokens = 0
        self.accepted_tokens = 0

    def propose(self, req):
        ref = self.continuations.get(tuple(req.prompt_ids))
        if ref is None:
            return None
        done = len(req.output_ids)
        nxt = list(ref[done : done + self.k])
        if not nxt:
            return None
        for i, t in enumerate(nxt):
            if self.rng.random() < self.corrupt:
                nxt[i] = (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return self.tree_type(tokens=tuple(nxt), parents=tuple(range(-1, len(nxt) - 1)))

    def observe(self, req, tree, accepted: int) -> None:
        self.proposed_steps += 1
        self.proposed_tokens += len(tree.tokens)
        self.accepted_tokens += accepted

    def forget(self, rid) -> None:
        pass


def _decode_rate(req) -> float:
    n = len(req.output_ids)
    return round((n - 1) / (req.finish_time - req.first_token_time), 1)


class TokenDrivenWeights:
    """Random weights whose greedy continuation survives the verify step's other kernels.

    With every weight random, the hidden state is chaotic: the 1e-3 differences between the decode kernel
    and the verify kernel flip the argmax among near-equal logits, so drafts copied from a plain decode
    stop matching a few tokens in (whatever the acceptance rule). Scaling each layer's output projections
    (attention's o_proj, the MLP's down_proj) by `scale` leaves the residual stream the input token's
    embedding, so the next token is a function of the current one and kernel noise cannot flip it; the step
    reads and computes exactly what it did before. The scale must put the layers' outputs below the bf16
    spacing of the embedding: at 1e-3 they still steered the tokens on the H200 (0.03 drafts accepted a
    step), at 1e-6 every forced draft was accepted. The originals come back on exit."""

    def __init__(self, model: torch.nn.Module, scale: float):
        self.params = [p for n, p in model.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))]
        self.scale = scale

    def __enter__(self):
        self.saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.mul_(self.scale)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved):
                p.copy_(saved)
        self.saved = []


def forced_acceptance(loaded, args) -> dict:
    with TokenDrivenWeights(loaded.model, args.output_scale) as scaled:
        out = _forced_acceptance(loaded, args)
    out["output_projections_scaled_by"] = args.output_scale
    out["scaled_tensors"] = len(scaled.params)
    return out


def _forced_acceptance(loaded, args) -> dict:
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.accept_prompt_len,), generator=g).tolist()
    common = {"device": args.device, "dtype": args.dtype, "attention_backend": "triton" if args.device == "cuda" else "torch_native", "max_running_requests": 4,
              "cuda_graph_max_bs": 4, "max_total_tokens": 4 * (args.accept_prompt_len + args.accept_output + 64),
              "disable_radix_cache": True}
    params = SamplingParams(max_new_tokens=args.accept_output, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=16, ignore_eos=True)
    out = {"prompt_len": args.accept_prompt_len, "output_len": args.accept_output, "draft_tokens": args.accept_k,
           "runs": [], "errors": {}}

    engine = Engine(EngineConfig(**common), loaded=loaded)
    try:
        engine.add_request(prompt, warm)
        engine.run_until_done()
        req = engine.add_request(prompt, params)
        engine.run_until_done()
        ref = list(req.output_ids)
        out["plain_tok_s"] = _decode_rate(req)
    finally:
        engine.close()
        del engine
        _free(args.device == "cuda")
    print(json.dumps({"plain_tok_s": out["plain_tok_s"]}), flush=True)

    for corrupt in args.corrupt:
        label = f"corrupt={corrupt}"
        try:
            k = args.accept_k
            cfg = EngineConfig(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=k,
                               speculative_eagle_topk=1, speculative_num_steps=k)
            engine = Engine(cfg, loaded=loaded)
            try:
                drafter = ForcedDrafter({tuple(prompt): ref}, k, corrupt, vocab)
                engine.drafter = drafter
                engine.add_request(prompt, warm)
                engine.run_until_done()
                drafter.proposed_steps = drafter.proposed_tokens = drafter.accepted_tokens = 0
                req = engine.add_request(prompt, params)
                engine.run_until_done()
                got = list(req.output_ids)
                if drafter.proposed_steps == 0:
                    raise RuntimeError("the forced drafter was never asked: the engine does not draft through "
                                       "engine.drafter")
                same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                run = {
                    "corrupt": corrupt,
                    "spec_tok_s": _decode_rate(req),
                    "speedup": round(_decode_rate(req) / out["plain_tok_s"], 3),
                    "verify_steps": drafter.proposed_steps,
                    "accepted_per_step": round(drafter.accepted_tokens / max(drafter.proposed_steps, 1), 3),
                    "acceptance_rate": round(drafter.accepted_tokens / max(drafter.proposed_tokens, 1), 3),
                    "outputs_identical": got == ref,
                    "first_difference_at": None if got == ref else same,
                    "steps_graphed_with_warmup": engine.runner.steps_graphed,
                    "steps_eager_with_warmup": engine.runner.steps_eager,
                    "cuda_graphs": engine.parts.graphs.note,
                }
                out["runs"].append(run)
                print(json.dumps(run), flush=True)
            finally:
                engine.close()
                del engine
                _free(args.device == "cuda")
        except Exception as exc:  # noqa: BLE001 - the speculative engine may not exist yet
            out["errors"][label] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    return out


# ---- report -------------------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    for part in report.get("verify_cost", []):
        cases = part.get("cases", [])
        if not cases:
            continue
        keys = [k for k in cases[0] if k.startswith(("verify_ms", "ratio"))]
        print(f"\n(a) {part['backend']}, context {part['context']}: ms per step (ratio = verify / decode)")
        print(f"{'batch':>5} {'decode':>8} " + " ".join(f"{k.split(' ', 1)[1]:>9}" for k in keys
                                                         if k.startswith("verify_ms")))
        for c in cases:
            cells = []
            for k in keys:
                if k.startswith("verify_ms"):
                    r = c.get("ratio " + k.split(" ", 1)[1])
                    cells.append(f"{c.get(k, float('nan')):>5.2f}" + (f"/{r:.2f}x" if r else ""))
            print(f"{c['batch']:>5} {c.get('decode_ms', float('nan')):>8.3f} " + " ".join(f"{x:>9}" for x in cells))
    acc = report.get("forced_acceptance")
    if acc:
        print(f"\n(b) batch 1, {acc['draft_tokens']} draft tokens: plain {acc.get('plain_tok_s')} tok/s")
        for r in acc.get("runs", []):
            print(f"  corrupt {r['corrupt']}: {r['spec_tok_s']} tok/s ({r['speedup']}x), accepted/step "
                  f"{r['accepted_per_step']}, identical {r['outputs_identical']}")
    if any(p.get("errors") for p in report.get("verify_cost", [])) or (acc or {}).get("errors") or report["errors"]:
        print("\nerrors: see the JSON")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b", help="a preset name or a directory holding config.json")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--draft-tokens", default="2,4,8", help="K of part (a); K = 4 also runs as a tree")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--backends", default="triton,flashinfer", help="part (a); flashinfer only if importable")
    ap.add_argument("--no-prefill-tiles", dest="prefill_tiles", action="store_false",
                    help="skip part (a)'s extra K = 4 row on the architecture's prefill tiles")
    ap.add_argument("--accept-prompt-len", type=int, default=256)
    ap.add_argument("--accept-output", type=int, default=256)
    ap.add_argument("--accept-k", type=int, default=4)
    ap.add_argument("--output-scale", type=float, default=1e-6,
                    help="part (b): o_proj and down_proj scaled by this, so greedy tokens follow the input token "
                         "and survive kernel noise (1: the plain random weights)")
    ap.add_argument("--corrupt", default="0,0.3", help="part (b): probabilities of a wrong draft token")
    ap.add_argument("--parts", default="a,b")
    ap.add_argument("--device", default="cuda",
                    help="cpu only to check the script (no graphs there: part (a) records why)")
    ap.add_argument("--out", default="benchmarks/results/spec-h200.json",
                    help="a JSON file, or a folder to write spec-h200.json into")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.draft_tokens = [int(x) for x in args.draft_tokens.split(",")]
    args.corrupt = [float(x) for x in args.corrupt.split(",")]
    args.dtype = "bf16" if args.device == "cuda" else "fp32"
    out_path = Path(args.out)
    if out_path.suffix != ".json":
        out_path = out_path / "spec-h200.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    import triton

    cuda = args.device == "cuda"
    report = {
        "what": f"{args.preset} random weights {args.dtype}; (a) verify step vs decode step, context {args.context}, "
                f"graphed; (b) batch 1 with drafts forced to the greedy continuation",
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (script check only)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "PYTHONPATH=src python3 benchmarks/spec_h200.py " + " ".join(
            f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k not in ("out", "dtype")),
        "verify_cost": [],
        "errors": {},
    }

    def write():
        out_path.write_text(json.dumps(report, indent=2))

    start = time.perf_counter()
    try:
        from attnserve.models.loader import load_model

        loaded = load_model(args.preset, dtype=args.dtype, device=args.device, random_weights=True)
        report["load_s"] = round(time.perf_counter() - start, 1)
    except Exception as exc:
        report["errors"]["load"] = f"{type(exc).__name__}: {exc}"
        write()
        raise
    parts = args.parts.split(",")

    def part_a(name: str) -> None:
        if name == "flashinfer":
            try:
                import flashinfer  # noqa: F401
            except ImportError:
                report["skipped"] = "flashinfer: not importable"
                return
        try:
            report["verify_cost"].append(verify_cost(loaded, name, args))
        except Exception as exc:  # noqa: BLE001
            report["errors"][f"verify_cost {name}"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            _free(cuda)
        write()

    backends = args.backends.split(",")
    if "a" in parts:  # the first backend, then (b), then the others: a slow JIT build of a peer comes last
        part_a(backends[0])
    if "b" in parts:
        try:
            report["forced_acceptance"] = forced_acceptance(loaded, args)
        except Exception as exc:  # noqa: BLE001
            report["errors"]["forced_acceptance"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        write()
    if "a" in parts:
        for name in backends[1:]:
            part_a(name)
    report["total_s"] = round(time.perf_counter() - start, 1)
    write()
    print_table(report)
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
