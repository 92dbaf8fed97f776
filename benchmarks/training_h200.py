"""Forward + backward race of attnserve.analysis.training against torch SDPA (flash and cuDNN backends).

Causal self-attention, bf16, head_dim 128, batch x T = 16k tokens, 16 heads, at T = 1k..16k. First a sweep at
T = 1k, 4k and 16k picks the forward (the blocked kernel's tiles, or the serving prefill kernel through
analysis.training.forward_tma in either work order) and each backward kernel's tile, by the lowest mean time
against the best candidate at each T; every time is recorded, and the choice is the default for the rest of the
run. Then every backend's forward and backward are timed (CUDA-event medians, triton.testing.do_bench) and
checked against each other; ours runs twice, on [B, H, T, D] tensors and on [B, T, H, D] ones viewed per head.
FLOPs: forward 4 * B * H * T^2 * D / 2 (causal), backward 2.5x that (five matmuls against two).

FA4 (`flash_attn.cute.interface.flash_attn_func`, forward and backward) races too where it imports, in its own
[B, T, H, D] layout (inputs and dO made in that layout before timing, outputs turned back only for the check).

Then the traffic model against the DRAM bytes the kernels move: Nsight Compute's dram__bytes counters when
`ncu` runs here, else the time x peak bandwidth upper bound, for several T.

    python benchmarks/training_h200.py --out results.json            # on the GPU
    python benchmarks/training_h200.py --out r.json --seqlens 1024 --no-sweep --no-ncu   # quick
    python benchmarks/training_h200.py --device cpu --out /tmp/t.json    # the whole script in seconds, on the
                                     # CPU under TRITON_INTERPRET=1 (fp16, tiny shapes; SDPA's GPU backends fail)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

# compiled kernels on the GPU, the interpreter on the CPU: the variable must be settled before triton is imported
CPU_RUN = any(a == "--device=cpu" or (a == "--device" and sys.argv[i + 1:i + 2] == ["cpu"])
              for i, a in enumerate(sys.argv))
if CPU_RUN:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
DEVICE = "cpu" if CPU_RUN else "cuda"
DTYPE = None  # torch.float16 on the CPU (the interpreter's bf16 dot is wrong), else torch.bfloat16; set in main

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from attnserve.analysis import traffic  # noqa: E402
from attnserve.analysis.training import flash_attention_with_lse, kernels  # noqa: E402
from attnserve.analysis.training.kernels import Tiles  # noqa: E402
from attnserve.versions import package_versions  # noqa: E402

# the backward's tiles (BLOCK_M, BLOCK_N, warps, stages[, diagonal split[, TMA descriptors[, fused dQ]]]), each
# kernel swept with the other held at its default (kernels.Tiles); a fused-dQ dkdv tile launches no dq kernel, so
# its time is the whole backward's; tools/compile_training_sm90.py gives each one's spills
DKDV_CANDIDATES = [(32, 128, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3, 2), (64, 128, 8, 2), (16, 128, 8, 4),
                   (32, 128, 8, 3, 1, 1), (32, 128, 8, 2, 1, 1), (32, 128, 8, 3, 2, 1),
                   (32, 128, 8, 3, 1, 0, 1), (32, 128, 8, 2, 1, 0, 1), (32, 128, 8, 3, 1, 1, 1),
                   (32, 128, 8, 3, 2, 1, 1), (64, 128, 8, 2, 1, 1, 1), (16, 128, 8, 4, 1, 1, 1)]
DQ_CANDIDATES = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3, 2), (64, 64, 4, 3), (128, 64, 8, 3, 1, 1),
                 (128, 64, 8, 2, 1, 1), (128, 32, 8, 3, 1, 1), (128, 128, 8, 2, 1, 1), (128, 64, 8, 4, 1, 1),
                 (128, 64, 8, 3, 2, 1)]
SWEEP_SEQLENS = (1024, 4096, 16384)  # each candidate's time against the best at every T, averaged


def forward_candidates(d):
    """label -> what kernels.forward's tma argument takes: the blocked kernel's tiles, or the prefill kernel's
    config and work order (its sm90 default at this head dim, the same in the other order, and unspecialised)."""
    from attnserve.analysis.training.forward_tma import TmaForward
    from attnserve.attention.kernels.mha.prefill_tma import PREFILL_TMA_TILES, PrefillTmaConfig

    table = kernels.GPU_TILES[128 if d > 64 else 64].fwd  # the table's blocked tile races too
    out = {f"blocked {c}": ("blocked", c) for c in dict.fromkeys([table, (128, 64, 8, 3), (128, 128, 8, 3)])}
    default = PREFILL_TMA_TILES.get(d)
    if default is not None:
        for order in ("heads_fastest", "head_by_head"):
            out[f"tma {order}"] = ("tma", TmaForward(default, order))
        if default.warp_specialize:
            out["tma unspecialised"] = ("tma", TmaForward(PrefillTmaConfig(128, 128, 8, 2, False), "heads_fastest"))
            # one program a tile, launched in the list's order, the key loop specialised: head_by_head launches
            # each head's tiles together, as the blocked kernel's grid does (its K and V stay in L2)
            one_per_tile = dataclasses.replace(default, persistent=0)
            for order in ("head_by_head", "heads_fastest"):
                out[f"tma one program a tile {order}"] = ("tma", TmaForward(one_per_tile, order))
    return out


def _inputs(b, h, t, d, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, t, d, device=DEVICE, dtype=DTYPE, generator=g) for _ in range(4))
    return q, k, v, do


def _ms(fn, rep=60):
    if CPU_RUN:  # one warm call, then one timed: the CPU run checks the script, its times mean nothing
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _empty_cache():
    if not CPU_RUN:
        torch.cuda.empty_cache()


def _forward_with(candidate, q, k, v, scale, tiles):
    kind, what = candidate
    if kind == "blocked":
        return kernels.forward(q, k, v, True, scale, None, None, Tiles(what, tiles.dkdv, tiles.dq), tma=None)
    return kernels.forward(q, k, v, True, scale, None, None, tiles, tma=what)


def _pick(times_by_t):
    """The candidate with the lowest mean of (its time / the best time) over the swept T, and those means."""
    means = {}
    for name in {n for per in times_by_t.values() for n in per}:
        ratios = []
        for per in times_by_t.values():
            timed = {n: x for n, x in per.items() if isinstance(x, float)}
            if name not in timed:
                break
            ratios.append(timed[name] / min(timed.values()))
        else:
            means[name] = sum(ratios) / len(ratios)
    return (min(means, key=means.get) if means else None), means


def sweep(tokens, h, d, seqlens=SWEEP_SEQLENS):
    """The forward path and each backward kernel's tile with the lowest mean time against the best, over seqlens
    (batch x T = tokens); every candidate is checked against the default forward before it is timed."""
    scale = d ** -0.5
    base = kernels.tiles_for(d)
    fwd_cands = forward_candidates(d)
    out = {"tokens": tokens, "heads": h, "head_dim": d, "seqlens": list(seqlens), "fwd": {}, "dkdv": {}, "dq": {}}
    for t in seqlens:
        q, k, v, do = _inputs(max(1, tokens // t), h, t, d, seed=t)
        ref, _ = kernels.forward(q, k, v, True, scale, None, None, base, tma=None)
        per = out["fwd"].setdefault(str(t), {})
        for name, cand in fwd_cands.items():
            try:
                o, _ = _forward_with(cand, q, k, v, scale, base)
                err = (o.float() - ref.float()).abs().max().item()
                per[name] = (_ms(lambda: _forward_with(cand, q, k, v, scale, base)) if err < 0.05
                             else f"wrong: max abs diff {err:.3g} against the blocked forward")
            except Exception as exc:  # noqa: BLE001 - a candidate that does not build or fit is recorded
                per[name] = repr(exc)[:200]
        o, lse = kernels.forward(q, k, v, True, scale, None, None, base, tma=None)
        want = kernels.backward(do, q, k, v, o, lse, True, scale, None, None, base)
        for name, cands in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
            per = out[name].setdefault(str(t), {})
            default = getattr(base, name)
            for c in [default] + [c for c in cands if c != default]:  # the head dim's default races too
                tiles = Tiles(base.fwd, c, base.dq) if name == "dkdv" else Tiles(base.fwd, base.dkdv, c)
                try:
                    got = kernels.backward(do, q, k, v, o, lse, True, scale, None, None, tiles)
                    err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                              for g, w in zip(got, want))
                    if not err <= 0.02:  # NaN too
                        per[str(c)] = f"wrong: max abs diff {err:.3g} of the largest gradient against the default"
                        continue
                    # the whole backward: delta + both kernels; the other kernel's share is the same for every c
                    per[str(c)] = _ms(lambda: kernels.backward(do, q, k, v, o, lse, True, scale, None, None, tiles))
                except Exception as exc:  # noqa: BLE001
                    per[str(c)] = repr(exc)[:200]
        _empty_cache()
    chosen = {}
    for name in ("fwd", "dkdv", "dq"):
        best, means = _pick(out[name])
        out[f"{name}_mean_vs_best"] = means
        chosen[name] = best
    fwd = fwd_cands.get(chosen["fwd"], ("blocked", base.fwd))
    def tile(key, default):  # "(32, 128, 8, 3)" -> (32, 128, 8, 3)
        return tuple(json.loads(key.replace("(", "[").replace(")", "]"))) if key else default

    tiles = Tiles(fwd[1] if fwd[0] == "blocked" else base.fwd, tile(chosen["dkdv"], base.dkdv),
                  tile(chosen["dq"], base.dq))
    out["chosen"] = {"fwd": chosen["fwd"], "tiles": {"fwd": tiles.fwd, "dkdv": tiles.dkdv, "dq": tiles.dq}}
    return tiles, (fwd[1] if fwd[0] == "tma" else None), out


def apply_choice(d, tiles, tma):
    """Make the sweep's choice the default of this head dim for what follows (race, traffic, ncu child)."""
    from attnserve.analysis.training import forward_tma

    kernels.GPU_TILES[128 if d > 64 else 64] = tiles
    forward_tma.GPU_TMA_FORWARD[d] = tma


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
    def ours(q, k, v):
        return flash_attention_with_lse(q, k, v, causal=True)[0]

    def ours_bthd(q, k, v):  # [B, T, H, D] tensors viewed per head, as a projection's output is
        return ours(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    # ours twice: on [B, H, T, D] tensors, and on FA4's [B, T, H, D] layout
    backends = {"attnserve": (ours, "bhtd"), "attnserve-bthd": (ours_bthd, "bthd"),
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
            for peer in ("attnserve-bthd", "sdpa-flash", "sdpa-cudnn", "fa4"):
                if peer in outs:
                    o1, g1 = outs["attnserve"]
                    o2, g2 = outs[peer]
                    check[peer] = {"out": (o1.float() - o2.float()).abs().max().item(),
                                   **{f"d{n}": (a.float() - c.float()).abs().max().item()
                                      for n, a, c in zip("qkv", g1, g2)}}
        peers = [r for n, r in results.items() if not n.startswith("attnserve") and "fwd_ms" in r]
        ratio = {}
        for name, suffix in (("attnserve", ""), ("attnserve-bthd", "_bthd")):
            mine = results.get(name, {})
            if peers and "fwd_ms" in mine:
                ratio[f"fwd_vs_best_peer{suffix}"] = min(p["fwd_ms"] for p in peers) / mine["fwd_ms"]
                ratio[f"bwd_vs_best_peer{suffix}"] = min(p["bwd_ms"] for p in peers) / mine["bwd_ms"]
        rec = {"T": t, "batch": b, "heads": h, "head_dim": d, "results": results, "max_abs_diff": check, **ratio}
        records.append(rec)
        print(json.dumps({"T": t, **{n: {kk: round(vv, 1) for kk, vv in r.items() if kk.endswith("tflops")}
                                     for n, r in results.items()}, **ratio}), flush=True)
        del outs
        _empty_cache()
    return records


# DRAM bytes for the traffic model; the tensor (wgmma) pipe's busy share, issue slots, warps resident, registers and
# the largest stall reasons for what bounds each kernel (one launch of each kernel per profiled process)
NCU_METRICS = ",".join([
    "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
    "regex:sm__pipe_(tensor_op_gmma|tensor_op_hmma)_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_issued.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    ("regex:smsp__average_warp_latency_issue_stalled_(long_scoreboard|short_scoreboard|barrier|wait|math_pipe_throttle"
     "|mio_throttle|lg_throttle|no_instruction|membar|sleeping|dispatch_stall|selected).ratio"),
])
NCU_KERNELS = ("_fwd_kernel", "_prefill_tma_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel")


def ncu_child(t, h, d, choice_json):
    """Run one forward and one backward with the parent's choice of forward and tiles (what ncu profiles)."""
    from attnserve.analysis.training import forward_tma

    global DTYPE
    DTYPE = torch.bfloat16
    choice = json.loads(choice_json)
    tiles = Tiles(*[tuple(x) for x in choice["tiles"]])
    if choice["fwd"]:  # swept: the parent's forward; else the table's, as the parent ran it
        kind, what = forward_candidates(d)[choice["fwd"]]
        apply_choice(d, tiles, what if kind == "tma" else None)
    else:
        apply_choice(d, tiles, forward_tma.GPU_TMA_FORWARD.get(d))
    q, k, v, do = _inputs(1, h, t, d)
    x = [z.requires_grad_() for z in (q, k, v)]
    o = flash_attention_with_lse(*x, causal=True)[0]
    torch.autograd.grad(o, x, do)
    torch.cuda.synchronize()


def traffic_check(seqlens, h, d, tiles, fwd_label, use_ncu, bw_tb_s):
    from attnserve.analysis.training import forward_tma

    tma = forward_tma.default_tma_forward(d, torch.device(DEVICE))
    fwd_tile = (tma.config.block_m, tma.config.block_n) if tma is not None else tiles.fwd[:2]
    shape_tile_fwd = traffic.Tile(br=fwd_tile[0], bc=fwd_tile[1])
    out = []
    ncu = shutil.which("ncu") if use_ncu else None
    for t in seqlens:
        fb = traffic.forward_bytes(t, d, d, 2, shape_tile_fwd, True, h, h, order="rows")
        bb = traffic.backward_bytes(t, d, d, 2, traffic.Tile(br=tiles.dkdv[0], bc=tiles.dkdv[1]), True, h, h,
                                    order="rows", dq_tile=traffic.Tile(br=tiles.dq[0], bc=tiles.dq[1]))
        rec = {"T": t, "heads": h, "head_dim": d, "tiles": [tiles.fwd, tiles.dkdv, tiles.dq], "fwd": fwd_label,
               "fwd_tile": list(fwd_tile),
               "model_fwd_bytes": {"flash_rows_order": fb["flash"], "lower_bound": fb["lower_bound"],
                                   "naive": fb["naive"]},
               "model_bwd_bytes": {"flash_rows_order": bb["flash"], "lower_bound": bb["lower_bound"],
                                   "naive": bb["naive"]}}
        if ncu:
            cmd = [ncu, "--clock-control", "none", "--metrics", NCU_METRICS, "--csv", "-k",
                   "regex:" + "|".join(NCU_KERNELS), sys.executable, __file__,
                   "--ncu-child", str(t), "--heads", str(h), "--head-dim", str(d),
                   "--choice", json.dumps({"fwd": fwd_label, "tiles": [tiles.fwd, tiles.dkdv, tiles.dq]})]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                rec["ncu"] = _parse_ncu(p.stdout)
                if not rec["ncu"]:
                    rec["ncu_error"] = (p.stdout[-600:] + p.stderr[-600:])
            except subprocess.TimeoutExpired:
                rec["ncu_error"] = "timeout"
        q, k, v, _ = _inputs(1, h, t, d)
        ms = _ms(lambda: kernels.forward(q, k, v, True, d ** -0.5, None, None, tiles))  # the chosen forward
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
        key = next((k for k in NCU_KERNELS if k in name), name)
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
    ap.add_argument("--traffic-seqlens", default="1024,4096,16384")
    ap.add_argument("--sweep-seqlens", default=",".join(map(str, SWEEP_SEQLENS)))
    ap.add_argument("--ncu-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--choice", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a check of the script under TRITON_INTERPRET=1 (fp16, pass tiny shapes)")
    args = ap.parse_args()
    global DTYPE
    DTYPE = torch.float16 if CPU_RUN else torch.bfloat16
    if args.ncu_child is not None:
        ncu_child(args.ncu_child, args.heads, args.head_dim, args.choice)
        return 0
    t0 = time.time()
    props = None if CPU_RUN else torch.cuda.get_device_properties(0)
    result = {"gpu": props.name if props else "cpu (TRITON_INTERPRET=1: times mean nothing)",
              "sms": props.multi_processor_count if props else None,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              # torch, triton, CUDA and flash-attn-4 where installed (FA4 races then)
              "versions": {**package_versions(), "cudnn": torch.backends.cudnn.version(),
                           "python": platform.python_version()},
              "command": "python benchmarks/training_h200.py " + " ".join(sys.argv[1:]),
              "workload": {"causal": True, "dtype": str(DTYPE).removeprefix("torch."), "tokens": args.tokens,
                           "heads": args.heads,
                           "head_dim": args.head_dim},
              "flops": "fwd 4*B*H*T^2*D/2 (causal); bwd 2.5x fwd; fwd_bwd 3.5x fwd"}
    try:
        import flash_attn.cute  # noqa: F401

        result["fa4"] = "raced"
    except ImportError:
        result["fa4"] = "not installed"
    d = args.head_dim
    fwd_label = None  # the table's forward, unswept
    if not args.no_sweep:
        tiles, tma, result["sweep"] = sweep(args.tokens, args.heads, d,
                                            [int(x) for x in args.sweep_seqlens.split(",")])
        apply_choice(d, tiles, tma)
        fwd_label = result["sweep"]["chosen"]["fwd"]
        print("sweep", json.dumps(result["sweep"]), flush=True)
        print("sweep chosen", json.dumps(result["sweep"]["chosen"]), "mean time / best:",
              json.dumps({k: result["sweep"][f"{k}_mean_vs_best"] for k in ("fwd", "dkdv", "dq")}), flush=True)
    from attnserve.analysis.training import forward_tma

    tiles = kernels.tiles_for(d)
    tma = forward_tma.default_tma_forward(d, torch.device(DEVICE))
    result["tiles"] = {"fwd": tiles.fwd, "dkdv": tiles.dkdv, "dq": tiles.dq}
    result["forward"] = ({"kernel": "prefill_tma", "order": tma.order, "config": tma.config.__dict__}
                         if tma is not None else {"kernel": "blocked", "tiles": tiles.fwd})
    result["records"] = race([int(x) for x in args.seqlens.split(",")], args.tokens, args.heads, d)
    with open(args.out, "w") as f:  # the race is kept even if the traffic check below does not finish
        json.dump(result, f, indent=1)
    # copy bandwidth, the ceiling of the time x bandwidth bound
    x = torch.empty(2 * 1024**3 if not CPU_RUN else 1 << 20, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x), rep=40)
    bw = 2 * x.numel() / (ms * 1e-3) / 1e12
    result["copy_tb_s"] = bw
    del x, y
    result["traffic"] = traffic_check([int(t) for t in args.traffic_seqlens.split(",")], args.heads, d, tiles,
                                      fwd_label, not args.no_ncu, bw)
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out, f"in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
