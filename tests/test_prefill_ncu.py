"""benchmarks/prefill_ncu.py: every kernel of the profiled call is read back, and the child runs each workload kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "prefill_ncu.py"


@pytest.fixture(scope="module")
def ncu_script():
    return load_script("benchmarks/prefill_ncu.py")


# what ncu --csv --page raw prints: a header row, a units row, one row per kernel (numbers with thousands commas)
RAW = """==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","sm__inst_executed_pipe_alu.sum","sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warp_latency_issue_stalled_barrier.ratio","smsp__average_warp_latency_issue_stalled_wait.ratio","dram__bytes_read.sum"
"","","ns","inst","%","","","byte"
"0","mla_decode_split_kernel","1,200,000","5,000","40.5","3.5","1.25","2,000,000"
"1","_merge_tiled_kernel","30,000","100","2.0","0.5","0.25","1,000"
"""


def test_every_kernel_of_the_call_is_kept_and_the_longest_heads_the_record(ncu_script):
    kernels = ncu_script.parse_raw_csv(RAW)
    assert [k["Kernel Name"] for k in kernels] == ["mla_decode_split_kernel", "_merge_tiled_kernel"]
    rec = ncu_script.profile_record(kernels)
    assert rec["kernel"] == "mla_decode_split_kernel"
    assert rec["us"] == 1200.0 and rec["us_total"] == 1230.0
    assert [k["us"] for k in rec["kernels"]] == [1200.0, 30.0]
    assert rec["pipes_pct_of_peak"] == {"alu": 40.5}
    assert rec["inst_executed"] == {"alu": 5000.0}
    assert list(rec["top_stalls"]) == ["barrier", "wait"]
    assert rec["dram_read_mb"] == 2.0


def test_no_kernel_rows_reads_as_nothing(ncu_script):
    assert ncu_script.parse_raw_csv("==PROF== nothing profiled\n") == []


def test_an_unknown_workload_is_refused(ncu_script):
    with pytest.raises(SystemExit, match="no race workload"):
        ncu_script.find_workload("prefill 3x3")


def test_without_ncu_the_record_says_so(ncu_script, tmp_path, monkeypatch):
    monkeypatch.setattr(ncu_script.shutil, "which", lambda name: None)
    out = tmp_path / "ncu.json"
    assert ncu_script.main(["--workload", "prefill 2x48", "--out", str(out)]) == 1
    rec = json.loads(out.read_text())
    assert rec["ncu_error"] == "ncu is not on PATH" and rec["workload"] == "prefill 2x48"


def _child_env() -> dict:
    """The child as this suite runs: compiled on a GPU, under the interpreter without one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return env


@pytest.mark.parametrize("workload", ["prefill 2x48", "mla decode 4x64 h16 p1"])
def test_the_child_runs_one_call_of_triton(workload):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", "triton", "--workload", workload],
                          capture_output=True, text=True, env=_child_env(), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("triton: (")


def test_the_child_refuses_a_contestant_the_workload_has_no_racer_for():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", "sdpa-cudnn", "--workload", "mla decode 4x64 h16 p1"],
                          capture_output=True, text=True, env=_child_env(), timeout=600, check=False)
    assert proc.returncode != 0 and "has no racer" in proc.stderr


def test_the_gluon_switches_reach_the_profiled_child_and_a_misspelt_one_stops_first(ncu_script, tmp_path,
                                                                                    monkeypatch):
    """--gluon-set profiles a Gluon schedule that is built but off: the profiled child gets the switches (module
    switches set in this process would not reach it), and the record names them."""
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=RAW, stderr="")

    monkeypatch.setattr(ncu_script.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(ncu_script.subprocess, "run", fake_run)
    out = tmp_path / "ncu.json"
    assert ncu_script.main(["--workload", "prefill 2x48", "--contestants", "triton", "--gluon-set", "STAGES=3",
                            "--out", str(out)]) == 0
    assert commands[0][-2:] == ["--gluon-set", "STAGES=3"]
    assert json.loads(out.read_text())["gluon_set"] == "STAGES=3"
    with pytest.raises(SystemExit, match="no switch 'NOPE'"):
        ncu_script.main(["--workload", "prefill 2x48", "--gluon-set", "NOPE=1", "--out", str(out)])
    assert len(commands) == 1
