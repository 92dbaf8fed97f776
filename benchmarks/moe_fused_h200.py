"""The fused MoE kernel on one GPU at DeepSeek-V2-Lite's shapes: checked, timed against its peers, next to the
weights' read time; the tile sweep in the same run.

For each batch (tokens): the fused kernel is checked against the dense torch path (every expert on every
token) and torch's grouped GEMM, then the routed experts are timed three ways (dense bmm, torch's grouped
GEMM, fused) and a whole MoE layer two ways (router + routed + 2 shared experts with the torch ops, and with
the Triton op set that the engine picks on CUDA). Every figure is a CUDA-graph replay cycling through several
routings, so the weights come from HBM as in a model's step. The roofline is the bytes of the experts a batch
touches (the shared experts and router too, for the layer) over the copy bandwidth measured in the same run.
Then (`--sweep-budget-s`, 0 to skip) tools/sweep_fused_moe.py sweeps the tiles and the fused kernel is timed
again with the sweep's best: `python tools/sweep_fused_moe.py --apply OUT/sweep_fused_moe.json` ships them.

    PYTHONPATH=src python3 benchmarks/moe_fused_h200.py --out-dir benchmarks/results/moe_fused_h200
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_fused_moe", ROOT / "tools" / "sweep_fused_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 6)


def _moe_layer(preset: str, device: str):
    """A random DeepSeek MoE layer (router float32, experts bf16)."""
    from attnserve.models.config import ModelConfig
    from attnserve.models.moe import MoE

    cfg = ModelConfig.load(preset)
    torch.manual_seed(0)
    with torch.device(device):
        layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    layer.experts.to(torch.bfloat16)
    if layer.shared_experts is not None:
        layer.shared_experts.to(torch.bfloat16)
    return layer


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _routing(sweep, experts, tokens: int, top_k: int, tbps: float):
    """The routing sets of a batch and the row every case starts from: the touched experts' read time."""
    num_experts, _, hidden = experts.gate_up_proj.shape
    sets = sweep.routing_sets(tokens, num_experts, top_k, hidden, experts.gate_up_proj.device)
    touched = sum(ids.unique().numel() for _, _, ids in sets) / len(sets)
    roofline = touched * _bytes(experts) / num_experts / tbps / 1e6
    return sets, {"tokens": tokens, "experts_touched_mean": touched, "roofline_us": round(roofline, 2)}


def _check_and_time(sweep, row: dict, sets, paths: dict, dense: torch.Tensor) -> None:
    for name, fn in paths.items():
        if name != "dense":
            row[f"{name}_vs_dense_rel_err"] = _rel(fn(*sets[0]), dense)
        row[f"{name}_us"] = round(sweep.time_cycling([lambda s=s, fn=fn: fn(*s) for s in sets]), 2)
        row[f"{name}_fraction_of_roofline"] = round(row["roofline_us"] / row[f"{name}_us"], 3)


def expert_rows(sweep, experts, tokens: int, top_k: int, tbps: float) -> dict:
    """Check and time the routed experts at one batch size: dense, torch's grouped GEMM, fused; the alignments."""
    from attnserve.ops.kernels.fused_moe import align, fused_experts, moe_tiles
    from attnserve.ops.kernels.moe_align import align_in_one_launch
    from attnserve.ops.moe_align import align_by_expert

    num_experts, two_i, hidden = experts.gate_up_proj.shape
    sets, row = _routing(sweep, experts, tokens, top_k, tbps)
    shipped = moe_tiles(experts.gate_up_proj.device, tokens, num_experts, hidden, two_i // 2, top_k)
    row["shipped_tiles"] = shipped.to_json()
    paths = {"dense": experts.forward_dense,
             "fused": lambda x, w, i: fused_experts(x, experts.gate_up_proj, experts.down_proj, w, i)}
    if experts.grouped_mm_applies(sets[0][0]):
        paths["grouped"] = experts.forward_grouped
    with torch.no_grad():
        _check_and_time(sweep, row, sets, paths, experts.forward_dense(*sets[0]))
        for name, fn in (("align_torch", align_by_expert), ("align_one_program", align_in_one_launch),
                         ("align_picked", align)):
            row[f"{name}_us"] = round(sweep.time_cycling([lambda i=i, fn=fn: fn(i, num_experts, shipped.block_m)
                                                          for _, _, i in sets]), 2)
    row["fused_speedup_vs_dense"] = round(row["dense_us"] / row["fused_us"], 2)
    return row


def swept_tiles_row(sweep, experts, tokens: int, top_k: int, tbps: float, tiles) -> dict:
    """The fused kernel again, with the sweep's best tiles for this batch size."""
    from attnserve.ops.kernels.fused_moe import fused_experts

    sets, row = _routing(sweep, experts, tokens, top_k, tbps)
    row["tiles"] = tiles.to_json()
    paths = {"fused_swept": lambda x, w, i: fused_experts(x, experts.gate_up_proj, experts.down_proj, w, i,
                                                          tiles=tiles)}
    with torch.no_grad():
        _check_and_time(sweep, row, sets, paths, experts.forward_dense(*sets[0]))
    return row


def layer_rows(sweep, layer, tokens: int, tbps: float) -> dict:
    """The whole MoE layer (router, routed and shared experts) with the torch ops and with the Triton op set."""
    from attnserve.models.layers import use_ops
    from attnserve.ops import TORCH_OPS, triton_ops

    experts = layer.experts
    num_experts, _, hidden = experts.gate_up_proj.shape
    top_k = layer.gate.top_k
    xs = [x for x, _, _ in sweep.routing_sets(tokens, num_experts, top_k, hidden, experts.gate_up_proj.device)]
    with torch.no_grad():
        touched = sum(layer.gate(x)[1].unique().numel() for x in xs) / len(xs)
        fixed = _bytes(layer) - _bytes(experts)  # router and shared experts: read whole every step
        row = {"tokens": tokens, "experts_touched_mean": touched,
               "roofline_us": round((fixed + touched * _bytes(experts) / num_experts) / tbps / 1e6, 2)}
        outs = {}
        for name, ops in (("unfused", TORCH_OPS), ("fused", triton_ops())):
            use_ops(layer, ops)
            outs[name] = layer(xs[0])
            row[f"{name}_us"] = round(sweep.time_cycling([lambda x=x: layer(x) for x in xs]), 2)
            row[f"{name}_fraction_of_roofline"] = round(row["roofline_us"] / row[f"{name}_us"], 3)
        use_ops(layer, TORCH_OPS)
        row["fused_vs_unfused_rel_err"] = _rel(outs["fused"], outs["unfused"])
        row["fused_speedup"] = round(row["unfused_us"] / row["fused_us"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--sweep-budget-s", type=float, default=90.0, help="0: no sweep")
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="the whole run's: the sweep gets what is left of it, less 30 s to re-time its tiles")
    ap.add_argument("--sweep-tokens", default=None, help="default: tools/sweep_fused_moe.py's list")
    ap.add_argument("--out-dir", default="benchmarks/results/moe_fused_h200")
    ap.add_argument("--device", default="cuda", help="cpu: check the script under TRITON_INTERPRET=1 with a tiny "
                    "--preset config.json (no roofline meaning)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if not cuda:
        from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

        let_interpreter_index_with_loaded_scalars()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sweep = _sweep_module()
    import triton

    from attnserve.bench.timing import copy_bandwidth_tbps

    tbps = copy_bandwidth_tbps(device=args.device) if cuda else copy_bandwidth_tbps(64 << 20, "cpu")
    layer = _moe_layer(args.preset, args.device)
    experts, top_k = layer.experts, layer.gate.top_k
    tokens = [int(t) for t in args.tokens.split(",")]
    shared = layer.shared_experts.down_proj.weight.shape[1] if layer.shared_experts is not None else 0
    report = {
        "what": f"{args.preset} MoE layer: {experts.num_experts} routed experts x (hidden {experts.gate_up_proj.shape[2]}, "
                f"channels {experts.intermediate_size}), top-{top_k}, shared experts of {shared} channels in all; "
                f"bf16, uniform random routing; CUDA-graph replays cycling through {sweep.ROUTINGS} routings",
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (a check of the script)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_TBps": round(tbps, 3),
        "routed_experts": [], "moe_layer": [], "errors": {},
        "command": "PYTHONPATH=src python3 benchmarks/moe_fused_h200.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
    }

    def save():
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out_dir / "moe_fused_h200.json").write_text(json.dumps(report, indent=2))

    def attempt(key, fn, *a):
        try:
            row = fn(*a)
            print(json.dumps(row), flush=True)
            return row
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            report["errors"][key] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if cuda:
                torch.cuda.synchronize()
            return None

    for t in tokens:
        for key, fn, a in (("routed_experts", expert_rows, (sweep, experts, t, top_k, tbps)),
                           ("moe_layer", layer_rows, (sweep, layer, t, tbps))):
            row = attempt(f"{key} {t}", fn, *a)
            if row:
                report[key].append(row)
        save()
    sweep_budget = min(args.sweep_budget_s, args.budget_s - (time.monotonic() - t0) - 30)
    report["sweep_budget_s"] = round(sweep_budget, 1)
    if sweep_budget > 0:
        sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else list(sweep.TOKENS)
        try:
            result = sweep.run(experts.num_experts, experts.gate_up_proj.shape[2], experts.intermediate_size, top_k,
                               sweep_tokens, sweep_budget, log=lambda r: None, device=args.device)
            (out_dir / "sweep_fused_moe.json").write_text(json.dumps(result, indent=1))
            report["sweep"] = {"file": "sweep_fused_moe.json", "tokens_swept": result["tokens_swept"],
                               "best": result["best"], "errors": result["errors"]}
            from attnserve.ops.moe_tiles import MoETiles

            best = {b["tokens"]: MoETiles.from_json(b["tiles"]) for b in result["best"]}
            report["routed_experts_swept_tiles"] = [
                row for t in tokens if t in best
                and (row := attempt(f"swept {t}", swept_tiles_row, sweep, experts, t, top_k, tbps, best[t]))]
        except Exception as exc:  # noqa: BLE001
            report["errors"]["sweep"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    save()
    print(json.dumps({"elapsed_s": report["elapsed_s"], "errors": report["errors"]}), flush=True)


if __name__ == "__main__":
    main()
