"""Forward + backward race of attnserve.analysis.training against torch SDPA (flash and cuDNN backends).

Causal self-attention, bf16, head_dim 128, batch x T = 16k tokens, 16 heads, at T = 1k..16k. First a short
sweep of the kernels' tiles at one T picks each kernel's tile (the chosen ones are recorded); then every
backend's forward and backward are timed (CUDA-event medians, triton.testing.do_bench) and checked against
each other. FLOPs: forward 4 * B * H * T^2 * D / 2 (causal), backward 2.5x that (five matmuls against two).

FA4 (`flash_attn.cute.interface.flash_attn_func`, forward and backward) races too where it imports, in its own
[B, T, H, D] layout (inputs and dO made in that layout before timing, outputs turned back only for the check).

Then the traffic model against the DRAM bytes the kernels move: Nsight Compute's dram__bytes counters when
`ncu` runs here, else the time x peak bandwidth upper bound, for several T.

    python benchmarks/training_h200.py --out results.json            # on the GPU
    python benchmarks/training_h200.py --out r.json --seqlens 1024 --no-sweep --no-ncu   # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: the variable must go before triton is imported

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from attnserve.analysis import traffic  # noqa: E402
from attnserve.analysis.training import flash_attention_with_lse, kernels  # noqa: E402
from attnserve.analysis.training.kernels import Tiles  # noqa: E402
from attnserve.versions import package_versions  # noqa: E402

FWD_CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3)]
DKDV_CANDIDATES = [(32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3)]
DQ_CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)]


def _inputs(b, h, t, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def _ms(fn, rep=60):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def sweep(b, h, t, d):
    """Each kernel's fastest tile at one shape (the others held at their defaults)."""
    q, k, v, do = _inputs(b, h, t, d)
    scale = d ** -0.5
    base = kernels.tiles_for(d)
    out = {"shape": [b, h, t, d], "fwd": {}, "dkdv": {}, "dq": {}}
    for c in FWD_CANDIDATES:
        tiles = Tiles(c, base.dkdv, base.dq)
        try:
            out["fwd"][str(c)] = _ms(lambda: kernels.forward(q, k, v, True, scale, None, None, tiles))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is skipped
            out["fwd"][str(c)] = repr(exc)[:200]
    o, lse = kernels.forward(q, k, v, True, scale, None, None)
    for name, cands in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
        for c in cands:
            tiles = Tiles(base.fwd, c, base.dq) if name == "dkdv" else Tiles(base.fwd, base.dkdv, c)
            try:
                # the whole backward: delta + both kernels; the other kernel's share is the same for every c
                out[name][str(c)] = _ms(lambda: kernels.backward(do, q, k, v, o, lse, True, scale, None, None, tiles))
            except Exception as exc:  # noqa: BLE001
                out[name][str(c)] = repr(exc)[:200]

    def best(name, default):
        timed = {kk: vv for kk, vv in out[name].items() if isinstance(vv, float)}
        return tuple(json.loads(min(timed, key=timed.get).replace("(", "[").replace(")", "]"))) if timed else default

    chosen = Tiles(best("fwd", base.fwd), best("dkdv", base.dkdv), best("dq", base.dq))
    out["chosen"] = {"fwd": chosen.fwd, "dkdv": chosen.dkdv, "dq": chosen.dq}
    return chosen, out


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fn(q, k, v):
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return fn


def _fa4():
    """FA4's differentiable attention in its [B, T, H, D] layout; None where flash_attn.cute does not import."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        return None

    def fn(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return fn


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, H, T, D] tensor in a contestant's layout: "bhtd" as is, "bthd" transposed and made contiguous."""
    return x if layout == "bhtd" else x.transpose(1, 2).contiguous()


def from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A contestant's output or gradient back in [B, H, T, D] (a view), for the cross-check."""
    return x if layout == "bhtd" else x.transpose(1, 2)


def race(seqlens, tokens, h, d):
    backends = {"attnserve": (lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True)[0], "bhtd"),
                "sdpa-flash": (_sdpa("flash"), "bhtd"), "sdpa-cudnn": (_sdpa("cudnn"), "bhtd")}
    fa4 = _fa4()
    if fa4 is not None:
        backends["fa4"] = (fa4, "bthd")
    records = []
    for t in seqlens:
        b = max(1, tokens // t)
        q, k, v, do = _inputs(b, h, t, d, seed=t)
        fwd_flops = 4 * b * h * t * t * d / 2
        results, outs = {}, {}
        for name, (fn, layout) in backends.items():
            x = [to_layout(z.detach(), layout).clone().requires_grad_() for z in (q, k, v)]
            dout = to_layout(do, layout)
            try:
                o = fn(*x)
                grads = torch.autograd.grad(o, x, dout, retain_graph=True)
                outs[name] = (from_layout(o.detach(), layout),
                              [from_layout(g.detach(), layout) for g in grads])
                fwd = _ms(lambda: fn(*x))
                bwd = _ms(lambda: torch.autograd.grad(o, x, dout, retain_graph=True))
                results[name] = {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": fwd_flops / fwd / 1e9,
                                 "bwd_tflops": 2.5 * fwd_flops / bwd / 1e9,
                                 "fwd_bwd_tflops": 3.5 * fwd_flops / (fwd + bwd) / 1e9}
            except Exception as exc:  # noqa: BLE001 - a peer that does not run here is recorded, not fatal
                results[name] = {"error": repr(exc)[:300]}
            del x
        check = {}
        if "attnserve" in outs:
            for peer in ("sdpa-flash", "sdpa-cudnn", "fa4"):
                if peer in outs:
                    o1, g1 = outs["attnserve"]
                    o2, g2 = outs[peer]
                    check[peer] = {"out": (o1.float() - o2.float()).abs().max().item(),
                                   **{f"d{n}": (a.float() - c.float()).abs().max().item()
                                      for n, a, c in zip("qkv", g1, g2)}}
        peers = [r for n, r in results.items() if n != "attnserve" and "fwd_ms" in r]
        ours = results.get("attnserve", {})
        ratio = {}
        if peers and "fwd_ms" in ours:
            ratio = {"fwd_vs_best_peer": min(p["fwd_ms"] for p in peers) / ours["fwd_ms"],
                     "bwd_vs_best_peer": min(p["bwd_ms"] for p in peers) / ours["bwd_ms"]}
        rec = {"T": t, "batch": b, "heads": h, "head_dim": d, "results": results, "max_abs_diff": check, **ratio}
        records.append(rec)
        print(json.dumps({"T": t, **{n: {kk: round(vv, 1) for kk, vv in r.items() if kk.endswith("tflops")}
                                     for n, r in results.items()}, **ratio}), flush=True)
        del outs
        torch.cuda.empty_cache()
    return records


NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"


def ncu_child(t, h, d, tiles_json):
    """Run one forward and one backward with fixed tiles (what ncu profiles)."""
    kernels.GPU_TILES[128 if d > 64 else 64] = Tiles(*[tuple(x) for x in json.loads(tiles_json)])
    q, k, v, do = _inputs(1, h, t, d)
    x = [z.requires_grad_() for z in (q, k, v)]
    o = flash_attention_with_lse(*x, causal=True)[0]
    torch.autograd.grad(o, x, do)
    torch.cuda.synchronize()


def traffic_check(seqlens, h, d, tiles, use_ncu, bw_tb_s):
    shape_tile_fwd = traffic.Tile(br=tiles.fwd[0], bc=tiles.fwd[1])
    out = []
    ncu = shutil.which("ncu") if use_ncu else None
    for t in seqlens:
        fb = traffic.forward_bytes(t, d, d, 2, shape_tile_fwd, True, h, h, order="rows")
        bb = traffic.backward_bytes(t, d, d, 2, traffic.Tile(br=tiles.dkdv[0], bc=tiles.dkdv[1]), True, h, h,
                                    order="rows", dq_tile=traffic.Tile(br=tiles.dq[0], bc=tiles.dq[1]))
        rec = {"T": t, "heads": h, "head_dim": d, "tiles": [tiles.fwd, tiles.dkdv, tiles.dq],
               "model_fwd_bytes": {"flash_rows_order": fb["flash"], "lower_bound": fb["lower_bound"],
                                   "naive": fb["naive"]},
               "model_bwd_bytes": {"flash_rows_order": bb["flash"], "lower_bound": bb["lower_bound"],
                                   "naive": bb["naive"]}}
        if ncu:
            cmd = [ncu, "--clock-control", "none", "--metrics", NCU_METRICS, "--csv", "-k",
                   "regex:_fwd_kernel|_delta_kernel|_dkdv_kernel|_dq_kernel", sys.executable, __file__,
                   "--ncu-child", str(t), "--heads", str(h), "--head-dim", str(d),
                   "--tiles", json.dumps([tiles.fwd, tiles.dkdv, tiles.dq])]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
                rec["ncu"] = _parse_ncu(p.stdout)
                if not rec["ncu"]:
                    rec["ncu_error"] = (p.stdout[-600:] + p.stderr[-600:])
            except subprocess.TimeoutExpired:
                rec["ncu_error"] = "timeout"
        q, k, v, _ = _inputs(1, h, t, d)
        ms = _ms(lambda: kernels.forward(q, k, v, True, d ** -0.5, None, None, tiles))
        rec["fwd_ms"] = ms
        rec["fwd_bytes_upper_bound_time_x_bw"] = ms * 1e-3 * bw_tb_s * 1e12
        out.append(rec)
        print(json.dumps(rec)[:600], flush=True)
    return out


def _parse_ncu(text):
    import csv
    import io

    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return {}
    per = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        name = row.get("Kernel Name", "")
        key = next((k for k in ("_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel") if k in name), name)
        metric, value, unit = row.get("Metric Name"), row.get("Metric Value", "0").replace(",", ""), row.get("Metric Unit", "")
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(unit, 1)
        try:
            per.setdefault(key, {})[metric] = per.get(key, {}).get(metric, 0) + float(value) * scale
        except ValueError:
            pass
    return per


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="training-h200.json")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument("--traffic-seqlens", default="4096,16384")
    ap.add_argument("--ncu-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tiles", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ncu_child is not None:
        ncu_child(args.ncu_child, args.heads, args.head_dim, args.tiles)
        return 0
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "sms": props.multi_processor_count,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              # torch, triton, CUDA and flash-attn-4 where installed (FA4 races then)
              "versions": {**package_versions(), "cudnn": torch.backends.cudnn.version(),
                           "python": platform.python_version()},
              "command": "python benchmarks/training_h200.py " + " ".join(sys.argv[1:]),
              "workload": {"causal": True, "dtype": "bf16", "tokens": args.tokens, "heads": args.heads,
                           "head_dim": args.head_dim},
              "flops": "fwd 4*B*H*T^2*D/2 (causal); bwd 2.5x fwd; fwd_bwd 3.5x fwd"}
    try:
        import flash_attn.cute  # noqa: F401

        result["fa4"] = "raced"
    except ImportError:
        result["fa4"] = "not installed"
    d = args.head_dim
    if not args.no_sweep:
        tiles, result["sweep"] = sweep(max(1, args.tokens // 4096), args.heads, 4096, d)
        kernels.GPU_TILES[128 if d > 64 else 64] = tiles
        print("sweep", json.dumps(result["sweep"]), flush=True)
    tiles = kernels.tiles_for(d)
    result["tiles"] = {"fwd": tiles.fwd, "dkdv": tiles.dkdv, "dq": tiles.dq}
    result["records"] = race([int(x) for x in args.seqlens.split(",")], args.tokens, args.heads, d)
    with open(args.out, "w") as f:  # the race is kept even if the traffic check below does not finish
        json.dump(result, f, indent=1)
    # copy bandwidth, the ceiling of the time x bandwidth bound
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x), rep=40)
    bw = 2 * x.numel() / (ms * 1e-3) / 1e12
    result["copy_tb_s"] = bw
    del x, y
    result["traffic"] = traffic_check([int(t) for t in args.traffic_seqlens.split(",")], args.heads, d, tiles,
                                      not args.no_ncu, bw)
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out, f"in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
