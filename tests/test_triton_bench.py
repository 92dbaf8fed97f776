"""`attnserve bench kernels`: workload names and costs, the CLI shape, a tiny CPU race end to end."""

import json

import pytest
import torch

from attnserve.bench.workloads import TINY_WORKLOADS, WORKLOADS, select
from attnserve.cli import build_parser, main


def test_workload_names_and_costs():
    names = [w.name for w in WORKLOADS]
    assert names == ["decode 64x4096 p1", "decode 64x4096 p16", "decode 128x2048 p16", "decode 256x1024 p1",
                     "decode 8x8192 p1", "decode 1x32768 p1", "prefill 8x2048", "prefill 1x16384",
                     "prefill 32x512", "extend 8x(4096+512)"]
    decode = WORKLOADS[0]
    assert decode.seq_len == 4096 and decode.kv_bytes(8, 128, 2) == 64 * 4096 * 8 * 128 * 2 * 2
    prefill = select(["prefill 8x2048"], WORKLOADS)[0]
    assert prefill.flops(32, 128) == 8 * 2 * 2048**2 * 128 * 32  # 2 * T^2 * d * H per sequence
    extend = WORKLOADS[-1]
    assert extend.flops(32, 128) == 4 * 128 * 32 * (512 * 4096 + 512 * 512 / 2) * 8
    with pytest.raises(ValueError, match="no workload matches"):
        select(["decode 3x3"], WORKLOADS)


def test_bench_is_a_command_with_sub_commands():
    args = build_parser().parse_args(["bench", "kernels", "--tiny", "--backends", "triton"])
    assert args.command == "bench" and args.bench == "kernels" and args.tiny
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench"])  # a sub-command is required


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny race is the CPU smoke run")
def test_tiny_race_writes_json_and_chart(tmp_path):
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--tiny", "--backends", "triton", "torch_native", "--workloads", "decode 4x64",
               "extend", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert {"gpu", "date", "versions", "ceilings", "records"} <= set(result)
    recs = {(r["workload"], r["backend"]): r for r in result["records"]}
    wanted = [w.name for w in TINY_WORKLOADS if w.mla is None and (w.name == "decode 4x64 p1" or w.kind == "extend")]
    for name in wanted:
        for backend in ("triton", "torch_native"):
            assert recs[(name, backend)]["rel_err"] < 1e-2
    assert recs[("extend 2x(40+24)", "triton")]["kernel_path"].startswith("prefill_tma")  # the race says which ran
    assert "kernel_path" not in recs[("extend 2x(40+24)", "torch_native")]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_kernels_without_a_gpu_says_so(capsys):
    assert main(["bench", "kernels", "--json", "/dev/null"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_mla_workloads_run_only_when_asked_for():
    from attnserve.bench.workloads import MLA_WORKLOADS

    assert [w.name for w in select(["mla"], WORKLOADS + MLA_WORKLOADS)] == [
        "mla decode 128x4096 h128 p1", "mla decode 64x8192 h128 p64", "mla decode 128x4096 h16 p64",
        "mla decode 1x32768 h128 p1", "mla extend 8x(4096+512) h128 p1",
        "mla extend 8x(4096+512) h16 p64"]
    assert all(w.mla is None for w in select(["decode"], WORKLOADS + MLA_WORKLOADS))
    assert all(w.mla is None for w in select(None, WORKLOADS + MLA_WORKLOADS))
    decode = MLA_WORKLOADS[0]  # issue 12's conventions: bytes = B*n*576*2, FLOPs = 2*B*heads*n*(576+512)
    assert decode.mla_bytes(2) == 128 * 4096 * 576 * 2
    assert decode.mla_flops() == 2 * 128 * 128 * 4096 * (576 + 512)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny race is the CPU smoke run")
def test_tiny_mla_race_checks_triton_against_the_oracle(tmp_path):
    out = tmp_path / "mla.json"
    rc = main(["bench", "kernels", "--tiny", "--backends", "triton", "torch_native", "--workloads", "mla decode 2x96",
               "mla extend", "--json", str(out)])
    assert rc == 0
    recs = {(r["workload"], r["backend"]): r for r in json.loads(out.read_text())["records"]}
    for name in ("mla decode 2x96 h16 p16", "mla extend 2x(40+24) h16 p4"):
        for backend in ("triton", "torch_native"):
            assert recs[(name, backend)]["rel_err"] < 1e-2, recs[(name, backend)]
