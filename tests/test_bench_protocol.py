"""The kernel race's protocol: alternated order, runs combined, ratios as ranges over runs, another
install's peers merged under their version; and FA4 / cuDNN SDPA among the contestants."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnserve.bench import kernels
from attnserve.bench.protocol import (
    add_ratios,
    combine_runs,
    format_ratio,
    label_peer_records,
    merge_peer_records,
    peer_label,
    ratio_range,
    run_order,
)
from attnserve.bench.racers import build_race_batch, racers_for
from attnserve.bench.workloads import TINY_WORKLOADS, WORKLOADS
from attnserve.choice.ranking import backend_family, rank
from attnserve.cli import main


def rec(workload, backend, us, **kw):
    return {"workload": workload, "backend": backend, "us": us, **kw}


def test_order_is_reversed_every_other_run():
    names = ["triton", "fa4", "flashinfer"]
    assert run_order(names, 0) == names and run_order(names, 2) == names
    assert run_order(names, 1) == ["flashinfer", "fa4", "triton"] == run_order(names, 3)


def test_runs_combine_into_median_times_with_rates_rescaled():
    run1 = [rec("w", "triton", 10.0, tflops=100.0, pct_of_ceiling=10.0, rel_err=1e-3, kernel_path="tma"),
            {"workload": "w", "backend": "fa4", "skipped": "RuntimeError: boom"}]
    run2 = [{"workload": "w", "backend": "fa4", "us": 8.0, "tflops": 125.0}, rec("w", "triton", 12.0, tflops=83.3)]
    run3 = [rec("w", "triton", 11.0, tflops=90.9), rec("w", "fa4", 9.0, tflops=111.1)]
    out = {r["backend"]: r for r in combine_runs([run1, run2, run3])}
    t = out["triton"]
    assert t["us_runs"] == [10.0, 12.0, 11.0] and t["us"] == 11.0
    assert t["tflops"] == pytest.approx(100.0 * 10 / 11, abs=1e-3) and t["pct_of_ceiling"] == pytest.approx(9.091)
    assert (t["rel_err"], t["kernel_path"]) == (1e-3, "tma")  # the first run's check and path
    f = out["fa4"]  # skipped in run 1, timed in runs 2 and 3
    assert f["us_runs"] == [None, 8.0, 9.0] and f["us"] == 8.5 and f["runs_without_time"] == 1
    assert "skipped" not in f
    assert [r["backend"] for r in combine_runs([run1, run2])] == ["triton", "fa4"]  # first seen, first listed
    one = combine_runs([run1])
    assert "us_runs" not in one[0] and one[0]["us"] == 10.0 and one[1]["skipped"] == "RuntimeError: boom"


def test_ratio_range_pairs_each_run_with_itself():
    # a peer slower by 10% in run 1 and faster by 10% in run 2: the range shows both, the medians would not
    assert ratio_range([11.0, 9.0], [10.0, 10.0]) == [0.9, 1.1]
    assert ratio_range([11.0, None], [10.0, 10.0]) == [1.1, 1.1]
    assert ratio_range([None], [10.0]) is None
    assert format_ratio(1.0, [0.9, 1.1]) == "1.00x (0.90-1.10)" and format_ratio(1.02, None) == "1.02x"


def test_ratios_against_flashinfer_and_the_best_peer_with_ranges():
    recs = [rec("w", "triton", 10.0, us_runs=[10.0, 10.0]),
            rec("w", "torch_native", 5.0, us_runs=[5.0, 5.0]),  # ours: never a peer, however fast
            rec("w", "flashinfer-fa3", 11.0, us_runs=[12.0, 10.0]),
            rec("w", "fa4", 10.5, us_runs=[9.0, 12.0]),
            {"workload": "w", "backend": "sdpa-cudnn", "skipped": "no"}]
    add_ratios(recs, "flashinfer-fa3")
    t = recs[0]
    assert (t["vs_flashinfer"], t["flashinfer_peer"], t["vs_flashinfer_range"]) == (1.1, "flashinfer-fa3", [1.0, 1.2])
    assert (t["best_peer"], t["vs_best_peer"]) == ("fa4", 1.05)
    assert t["vs_best_peer_range"] == [0.9, 1.0]  # run 1: fa4 9.0; run 2: flashinfer 10.0 is that run's best
    fi = recs[2]
    assert fi["best_peer"] == "fa4" and fi["vs_best_peer_range"] == [0.75, 1.2]  # against fa4 only: 9/12, 12/10
    assert "vs_best_peer" not in recs[3] and "vs_flashinfer" not in recs[4]
    single = [rec("w", "triton", 10.0), rec("w", "flashinfer", 12.0)]
    add_ratios(single, "flashinfer")
    assert single[0]["vs_flashinfer"] == 1.2 and "vs_flashinfer_range" not in single[0]


def test_another_installs_rows_are_labelled_and_merged_by_workload():
    child = [rec("a", "flashinfer-fa3", 9.0, vs_flashinfer=1.1, flashinfer_peer="x", vs_best_peer=1.0,
                 best_peer="y", vs_best_peer_range=[1, 1], rel_err=1e-3),
             rec("c", "flashinfer", 3.0)]
    label = peer_label({"flashinfer-python": "0.7.2.post1"})
    assert label == "@0.7.2.post1" and peer_label({}) == "@unknown"
    extra = label_peer_records(child, label, "/tmp/site2")
    assert extra[0] == {"workload": "a", "backend": "flashinfer-fa3@0.7.2.post1", "us": 9.0, "rel_err": 1e-3,
                        "peer_site": "/tmp/site2"}
    main_rows = [rec("a", "triton", 10.0), rec("a", "flashinfer-fa3", 11.0), rec("b", "triton", 1.0)]
    merged = merge_peer_records(main_rows, extra)
    assert [(r["workload"], r["backend"]) for r in merged] == [
        ("a", "triton"), ("a", "flashinfer-fa3"), ("a", "flashinfer-fa3@0.7.2.post1"), ("b", "triton"),
        ("c", "flashinfer@0.7.2.post1")]
    add_ratios(merged[:3], "flashinfer-fa3")  # the newer FlashInfer is a peer like any other
    assert merged[0]["best_peer"] == "flashinfer-fa3@0.7.2.post1" and merged[0]["vs_flashinfer"] == 1.1
    # the shipped selection order ranks what this install runs: another install's rows count for nothing
    assert backend_family("flashinfer-fa3@0.7.2.post1") is None and backend_family("fa4") == "fa4"
    assert [r.backend for r in rank(merged)] == ["triton", "flashinfer"]


def test_the_shipped_order_takes_fa4_from_a_race():
    from attnserve.choice.measured import order_entry

    race = {"gpu": "NVIDIA H200", "date": "2027-01-01", "records": [
        rec("prefill 8x2048", "triton", 10.0), rec("prefill 8x2048", "fa4", 8.0),
        rec("prefill 8x2048", "flashinfer-fa3", 9.0), rec("prefill 8x2048", "flashinfer-fa3@0.7.2.post1", 7.0),
        rec("prefill 8x2048", "sdpa-cudnn", 6.0)]}
    entry = order_entry(race, "kernels-race-h200-1.json")["MHA"]
    assert entry["prefill"] == ["fa4", "flashinfer", "triton"] and entry["scores"]["prefill"]["fa4"] == 1.0


def test_the_child_races_only_peers_from_the_site_first_on_the_path():
    args = SimpleNamespace(workloads=["prefill", "extend"], peer_backends=["flashinfer*"], tiny=False, no_check=False)
    cmd = kernels.child_command(args, 2, Path("/tmp/x.json"))
    assert cmd[1:6] == ["-m", "attnserve", "bench", "kernels", "--only-peers"]
    assert cmd[cmd.index("--runs") + 1] == "2" and cmd[cmd.index("--workloads") + 1:][:2] == ["prefill", "extend"]
    assert cmd[cmd.index("--backends") + 1] == "flashinfer*" and "--no-png" in cmd
    env = kernels.child_env(Path("/tmp/site2"), {"PYTHONPATH": "/tmp/site:src", "X": "1"})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == "/tmp/site2" and parts[-2:] == ["/tmp/site", "src"] and env["X"] == "1"
    assert (Path(parts[1]) / "attnserve" / "bench" / "kernels.py").is_file()


def test_fa4_and_cudnn_sdpa_race_where_they_apply():
    by_name = {w.name: w for w in WORKLOADS}
    prefill = racers_for(build_race_batch(TINY_WORKLOADS[2], device="cpu"), None)
    extend = racers_for(build_race_batch(TINY_WORKLOADS[3], device="cpu"), None)
    decode = racers_for(build_race_batch(TINY_WORKLOADS[0], device="cpu"), None)
    assert {"fa4", "sdpa-cudnn"} <= set(prefill) and "fa4" in extend and "sdpa-cudnn" not in extend
    assert "fa4" not in decode and "prefill 1x16384" in by_name
    assert "fa4" in kernels.CONTESTANT_ORDER


def test_versions_record_every_peer(monkeypatch):
    real = kernels.md.version
    fake = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.4.0", "flashinfer-python": "0.6.18"}

    def version(name):
        return fake[name] if name in fake else real(name)

    monkeypatch.setattr(kernels.md, "version", version)
    v = kernels._versions()
    assert v["flash-attn-4"] == "4.0.0b36" and v["nvidia-cutlass-dsl"] == "4.4.0" and v["flashinfer-python"] == "0.6.18"
    assert v["torch"] == torch.__version__ and "triton" in v
    assert ("cudnn" in v) == torch.backends.cudnn.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny race is the CPU smoke run")
def test_tiny_race_twice_with_a_peer_site_merges_its_rows(tmp_path, capsys):
    out = tmp_path / "k.json"
    site = tmp_path / "site2"
    site.mkdir()
    rc = main(["bench", "kernels", "--tiny", "--workloads", "prefill", "--backends", "torch_native", "sdpa-flash",
               "--runs", "2", "--peer-site", str(site), "--peer-backends", "sdpa-flash", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "run 2 of 2 (order reversed)" in printed and "--only-peers" in printed
    result = json.loads(out.read_text())
    assert result["runs"] == 2 and "L2 cold" in result["protocol"]
    assert result["peer_runs"][0]["site"] == str(site) and result["peer_runs"][0]["label"] == "@unknown"
    backends = [r["backend"] for r in result["records"]]
    assert backends == ["sdpa-flash", "torch_native", "sdpa-flash@unknown"]
    child_row = result["records"][-1]
    assert child_row["peer_site"] == str(site) and "torch_native" not in {r["backend"] for r in result["records"][2:]}
    assert all(r.get("rel_err", 1.0) < 1e-2 for r in result["records"] if "skipped" not in r)
    assert out.with_suffix(".png").stat().st_size > 0


def test_chart_takes_a_median_rounded_outside_its_runs(tmp_path):
    """Rounded times can put the median a hair past its runs (367.35 against runs of 367.3): the error bar is
    clamped at zero instead of matplotlib refusing a negative one and the race losing its chart."""
    from attnserve.bench.kernels import write_chart

    rec = {"workload": "prefill 8x2048", "backend": "triton", "us": 367.35, "us_runs": [367.3, 367.3],
           "tflops": 400.0}
    dec = {"workload": "decode 8x8192 p1", "backend": "triton", "us": 64.06, "us_runs": [64.0, 64.0], "tbps": 2.0}
    out = tmp_path / "race.png"
    write_chart({"gpu": "test", "date": "2026-12-06", "records": [rec, dec], "ceilings": {"copy_tbps": 3.0, "matmul_tflops": 700.0}}, out)
    assert out.stat().st_size > 1000
