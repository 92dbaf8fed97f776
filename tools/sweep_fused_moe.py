"""Sweep the fused MoE kernel's tiles (row block, output columns, reduction step, warps, stages) per token count
at one expert shape (DeepSeek-V2-Lite's by default), and turn the winners into the shipped tile table.

Each kernel is timed on its own, replayed from a CUDA graph that cycles through several routings (so the
experts' weights come from HBM, not L2, as in a model's step), and each tile's output is checked against the
first tile's, itself checked against the dense torch path: a tile that computes garbage fast cannot win. The
best row block for a token count is the one whose best gate/up and best down tiles sum to the least time.

    PYTHONPATH=src python3 tools/sweep_fused_moe.py --out sweep-fused-moe.json [--tokens 1,8,64] [--budget-s 150]
    python tools/sweep_fused_moe.py --apply sweep-fused-moe.json   # no GPU: write its rules into the package

--apply replaces the rules of the sweep's architecture (sm90 for an H200) in ops/fused_moe_tiles.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from attnserve.ops.moe_tiles import GemmTile, MoETiles, rules_from_sweep, write_rules

# token counts, most important first (a budget may end the list): decode at 1 and 64 requests, then the rest
TOKENS = (1, 64, 8, 512, 16, 32, 128, 256, 2, 4, 1024, 2048, 4096)
# tried for each kernel: narrow columns (many programs per expert, for a few tokens) to wide ones; the first
# must fit every shape and block_m (it is the reference the others are checked against)
GEMM_TILES = tuple(GemmTile(*t) for t in (
    (64, 64, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4),
    (64, 256, 4, 2), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3)))
ROUTINGS = 4  # routing sets cycled through in a graph: four top-6 batches of one token touch ~24 of 64 experts


def block_ms(tokens: int, top_k: int, experts: int) -> list[int]:
    """Row blocks worth trying: up to twice the pairs an expert gets on average (at least 16, at most 128)."""
    per_expert = max(1, tokens * top_k // experts)
    cap = min(128, max(16, 2 * (1 << (per_expert - 1).bit_length())))
    return [b for b in (16, 32, 64, 128) if b <= cap]


def routing_sets(tokens: int, experts: int, top_k: int, hidden: int, device: str, n: int = ROUTINGS, seed: int = 0):
    """n batches [(x [T, hidden] bf16, weights [T, k] float32, ids [T, k])] with uniform random routing."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
        weights, ids = torch.rand(tokens, experts, device=device, generator=g).topk(top_k, dim=-1)
        out.append((x, weights / weights.sum(-1, keepdim=True), ids))
    return out


def time_cycling(calls: list) -> float:
    """Microseconds per call, replaying a CUDA graph of the calls cycled through (bench.timing.time_graph);
    on the CPU (a check of the script under TRITON_INTERPRET=1) timed eagerly."""
    from attnserve.bench.timing import time_cpu, time_graph

    cycle = itertools.cycle(calls)
    if not torch.cuda.is_available():
        return time_cpu(lambda: next(cycle)(), min_run_s=0.01)
    return time_graph(lambda: next(cycle)(), calls_per_graph=4 * len(calls))


def random_experts(experts: int, hidden: int, intermediate: int, device: str):
    from attnserve.models.moe import Experts

    torch.manual_seed(0)
    with torch.device(device):
        e = Experts(experts, hidden, intermediate, "silu").to(torch.bfloat16)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0.0, 0.02)
    return e


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def sweep_tokens(experts, tokens: int, top_k: int, deadline: float, log) -> list[dict]:
    """Rows {"tokens", "block_m", "kernel", tile fields, "us" | "error"} for one token count."""
    from attnserve.ops.kernels.fused_moe import ExpertWeights, align, down_weighted, gate_up_silu

    num_experts, hidden = experts.num_experts, experts.gate_up_proj.shape[2]
    weights = ExpertWeights(experts.gate_up_proj, experts.down_proj)
    sets = routing_sets(tokens, num_experts, top_k, hidden, experts.gate_up_proj.device)
    dense = experts.forward_dense(*sets[0])
    rows = []
    for block_m in block_ms(tokens, top_k, num_experts):
        aligned = [align(ids, num_experts, block_m) for _, _, ids in sets]
        routing = [w.float().contiguous() for _, w, _ in sets]
        activated = [gate_up_silu(x, weights, a, top_k, GEMM_TILES[0]) for (x, _, _), a in zip(sets, aligned)]
        first = down_weighted(activated[0], weights, routing[0], aligned[0], top_k, GEMM_TILES[0])
        err = _rel(first.view(tokens, top_k, hidden).sum(1), dense)
        if err > 2e-2:
            raise AssertionError(f"fused MoE at {tokens} tokens, block_m {block_m}: {err:.3g} from the dense path")
        for kernel, tile in itertools.product(("gate_up", "down"), GEMM_TILES):
            if time.monotonic() > deadline:
                return rows
            row = {"tokens": tokens, "block_m": block_m, "kernel": kernel, **dataclasses.asdict(tile)}
            try:
                if kernel == "gate_up":
                    calls = [lambda x=x, a=a, tile=tile: gate_up_silu(x, weights, a, top_k, tile)
                             for (x, _, _), a in zip(sets, aligned)]
                    check = _rel(calls[0](), activated[0])
                else:
                    calls = [lambda h=h, r=r, a=a, tile=tile: down_weighted(h, weights, r, a, top_k, tile)
                             for h, r, a in zip(activated, routing, aligned)]
                    check = _rel(calls[0](), first)
                if check > 1e-2:
                    row["error"] = f"output {check:.3g} from the first tile's"
                else:
                    row["us"] = round(time_cycling(calls), 2)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            log(row)
            rows.append(row)
    return rows


def best_tiles(rows: list[dict]) -> list[dict]:
    """Per token count, the row block whose fastest gate/up and fastest down tiles sum to the least time."""
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        options = []
        for block_m in sorted({r["block_m"] for r in rows if r["tokens"] == tokens}):
            fastest = {}
            for kernel in ("gate_up", "down"):
                timed = [r for r in rows if (r["tokens"], r["block_m"], r["kernel"]) == (tokens, block_m, kernel)
                         and "us" in r]
                if timed:
                    fastest[kernel] = min(timed, key=lambda r: r["us"])
            if len(fastest) == 2:
                options.append((fastest["gate_up"]["us"] + fastest["down"]["us"], block_m, fastest))
        if options:
            us, block_m, fastest = min(options, key=lambda o: o[0])
            tile = {k: {f: fastest[k][f] for f in ("block_n", "block_k", "num_warps", "num_stages")} for k in fastest}
            tiles = MoETiles.from_json({"block_m": block_m, **tile}).to_json()
            out.append({"tokens": tokens, "tiles": tiles, "measured_us": {f"{tokens} tokens": round(us, 2)}})
    return out


def run(experts_n: int, hidden: int, intermediate: int, top_k: int, tokens: list[int], budget_s: float,
        log=print, device: str = "cuda") -> dict:
    """The sweep as a JSON-able dict (rows, best tiles per token count, the table rules they imply)."""
    from attnserve.attention.kernels.gpu_target import target_for

    if device == "cpu":
        from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

        let_interpreter_index_with_loaded_scalars()
    deadline = time.monotonic() + budget_s
    experts = random_experts(experts_n, hidden, intermediate, device)
    target = target_for(torch.device(device))
    shape = {"experts": experts_n, "hidden": hidden, "intermediate": intermediate, "top_k": top_k}
    rows, errors, swept = [], {}, []
    for t in tokens:
        if time.monotonic() > deadline:
            break
        try:
            rows += sweep_tokens(experts, t, top_k, deadline, log)
            swept.append(t)
        except Exception as exc:  # noqa: BLE001 - one token count failing must not lose the others
            errors[str(t)] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    best = best_tiles(rows)
    return {
        "arch": target.arch if target else "cpu (a check of the script)",
        "gpu": torch.cuda.get_device_name() if target else "cpu", "shape": shape,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "tokens_swept": swept, "budget_s": budget_s, "rows": rows, "best": best, "errors": errors,
        "tile_rules": rules_from_sweep(best, shape),
    }


def apply(path: str) -> int:
    sweep = json.loads(Path(path).read_text())
    if not sweep.get("tile_rules") or sweep["gpu"] == "cpu":
        sys.exit(f"{path}: no GPU tiles to apply (a CPU check, or nothing timed)")
    written = write_rules(sweep["arch"], sweep["tile_rules"], f"tools/sweep_fused_moe.py on {sweep['gpu']}, "
                          f"{sweep['date']}")
    print(f"wrote {len(sweep['tile_rules'])} {sweep['arch']} rules into {written}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apply", metavar="SWEEP_JSON", help="write a finished sweep's tile rules into the package")
    p.add_argument("--out", default="sweep-fused-moe.json")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new tiles after this long")
    p.add_argument("--device", default="cuda", help="cpu: check the script under TRITON_INTERPRET=1 (tiny shapes)")
    args = p.parse_args()
    if args.apply:
        return apply(args.apply)
    result = run(args.experts, args.hidden, args.intermediate, args.top_k, [int(t) for t in args.tokens.split(",")],
                 args.budget_s, log=lambda r: print(json.dumps(r)), device=args.device)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("tile_rules (apply with --apply):", json.dumps(result["tile_rules"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
