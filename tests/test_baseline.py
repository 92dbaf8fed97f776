"""The regression guard: `bench compare NEW OLD`, `bench kernels --baseline`, `tune --baseline` (in test_tune.py)."""

import json
from pathlib import Path

import pytest

from attnserve.bench.baseline import REGRESSION_EXIT
from attnserve.cli import main

COMMITTED_H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "kernels-h200.json"


def _run(times: dict, machine="NVIDIA H200", **extra) -> dict:
    """A bench kernels run: {(workload, backend): us}."""
    return {"gpu": machine, "date": "2026-12-01", "shapes": {"num_heads": 32, "head_dim": 128},
            "records": [{"workload": w, "backend": b, "us": us} for (w, b), us in times.items()], **extra}


TIMES = {("decode 64x4096 p1", "triton"): 250.0, ("decode 64x4096 p1", "flashinfer"): 260.0,
         ("prefill 8x2048", "triton"): 900.0, ("prefill 8x2048", "flashinfer-fa3"): 500.0}


def _compare(tmp_path, new: dict, old: dict, *flags) -> int:
    (tmp_path / "new.json").write_text(json.dumps(new))
    (tmp_path / "old.json").write_text(json.dumps(old))
    return main(["bench", "compare", str(tmp_path / "new.json"), str(tmp_path / "old.json"), *flags])


def test_identical_times_pass(tmp_path, capsys):
    assert _compare(tmp_path, _run(TIMES), _run(TIMES)) == 0
    assert "no regression: 4 timings" in capsys.readouterr().out


def test_a_baseline_twice_as_fast_names_every_slowed_workload(tmp_path, capsys):
    faster = {k: t / 2 for k, t in TIMES.items()}
    assert _compare(tmp_path, _run(TIMES), _run(faster)) == REGRESSION_EXIT
    out = capsys.readouterr().out
    assert "REGRESSION: 4 of 4" in out
    for (workload, backend) in TIMES:
        assert f"{workload} / {backend} (2.00x)" in out


def test_the_threshold_decides(tmp_path, capsys):
    slower = {k: t * 1.05 for k, t in TIMES.items()}  # 5% slower
    assert _compare(tmp_path, _run(slower), _run(TIMES)) == 0
    assert _compare(tmp_path, _run(slower), _run(TIMES), "--regression-threshold", "0.01") == REGRESSION_EXIT
    with pytest.raises(SystemExit) as exc:
        _compare(tmp_path, _run(TIMES), _run(TIMES), "--regression-threshold", "-1")
    assert exc.value.code == 2 and "must be >= 0" in capsys.readouterr().err


def test_a_backend_that_no_longer_runs_is_a_regression(tmp_path, capsys):
    new = _run(TIMES)
    new["records"][0] = {"workload": "decode 64x4096 p1", "backend": "triton", "skipped": "RuntimeError: boom"}
    new["records"].pop()  # not raced this time (another --backends): not compared, not a regression
    assert _compare(tmp_path, new, _run(TIMES)) == REGRESSION_EXIT
    out = capsys.readouterr().out
    assert "REGRESSION: 1 of 3" in out and "decode 64x4096 p1 / triton (fails)" in out


@pytest.mark.parametrize("old, says", [
    (_run(TIMES, machine="NVIDIA H100"), "measured on 'NVIDIA H100'"),
    ({**_run(TIMES), "shapes": {"num_heads": 64, "head_dim": 128}}, "num_heads 64 -> 32"),
    ({**_run(TIMES), "kind": "attnserve-tune", "machine": "NVIDIA H200", "shape": {}}, "`tune` run"),
    (_run({}), "no backend/workload was timed in both runs"),
], ids=["other-gpu", "other-shapes", "other-kind", "nothing-in-common"])
def test_incomparable_runs_are_refused(tmp_path, capsys, old, says):
    assert _compare(tmp_path, _run(TIMES), old) == 2
    err = capsys.readouterr().err
    assert "not compared" in err and says in err


def test_unreadable_baseline_is_refused(tmp_path, capsys):
    (tmp_path / "old.json").write_text("{oops")
    (tmp_path / "new.json").write_text(json.dumps(_run(TIMES)))
    assert main(["bench", "compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")]) == 2
    assert "run " + str(tmp_path / "old.json") + " can't be read" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["new", "old"])
def test_a_file_that_is_not_a_run_is_named(tmp_path, capsys, which):
    """Either side of the comparison: the error names the file that is not a run."""
    for name in ("new", "old"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"gpu": "x"} if name == which else _run(TIMES)))
    assert main(["bench", "compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")]) == 2
    err = capsys.readouterr().err
    assert f"run {tmp_path / (which + '.json')} is not a run of" in err and '(no "records" list)' in err


def test_bench_kernels_refuses_another_gpus_baseline_before_racing(tmp_path, capsys):
    """The committed H200 race, said to be from a GPU no machine here is: refused with exit 2, nothing raced
    or written (on any machine, the H200 included)."""
    other = {**json.loads(COMMITTED_H200.read_text()), "gpu": "Another GPU 9000"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--tiny", "--json", str(out), "--baseline", str(tmp_path / "other.json")]) == 2
    assert "measured on 'Another GPU 9000'" in capsys.readouterr().err
    assert not out.exists()
