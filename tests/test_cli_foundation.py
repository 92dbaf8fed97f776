"""`attnserve kv-calc` and `attnserve backends` through the CLI entry point."""

import json

import pytest

from attnserve.cli import main
from attnserve.presets import PRESETS


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_kv_calc_json(capsys):
    d = _json(capsys, ["kv-calc", "--model", "llama-3-70b", "--context", "8192", "--batch", "64",
                       "--gpu-memory-gb", "640", "--json"])
    for key in ("bytes_per_token", "total_bytes", "max_batch", "decode_intensity", "prefill_intensity"):
        assert key in d
    assert d["bytes_per_token"] == 320 * 1024
    assert d["total_bytes"] == 160 * 1024**3
    assert d["max_batch"] > 64


def test_kv_calc_mla_and_fp8(capsys):
    d = _json(capsys, ["kv-calc", "--model", "deepseek-v2", "--context", "4096", "--json"])
    assert d["bytes_per_token"] == 69120 and d["attention_type"] == "MLA"
    d8 = _json(capsys, ["kv-calc", "--model", "deepseek-v2", "--context", "4096", "--kv-cache-dtype", "fp8_e4m3",
                        "--json"])
    assert d8["bytes_per_token"] * 2 == d["bytes_per_token"]


def test_kv_calc_reads_a_config_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-2-7b"]))
    d = _json(capsys, ["kv-calc", "--model", str(tmp_path / "config.json"), "--context", "4096", "--json"])
    assert d["total_bytes"] == 2 * 1024**3


def test_kv_calc_table(capsys):
    assert main(["kv-calc", "--model", "llama-2-7b", "--context", "4096", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "512 KiB" in out and "2 GiB" in out and "max batch" in out


@pytest.mark.parametrize(
    "argv,message",
    [(["--model", "gpt-9", "--context", "10"], "llama-3-8b"),
     (["--model", "llama-3-8b", "--context", "0"], "context"),
     (["--model", "llama-3-8b", "--context", "10", "--kv-cache-dtype", "fp7"], "fp7")],
)
def test_kv_calc_bad_input_exits_2_with_a_message(capsys, argv, message):
    assert main(["kv-calc", *argv]) == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err


def _installed_here(monkeypatch, absent=(), present=()):
    """This machine as detect_hardware sees it, with `absent` reported missing and `present` installed."""
    from attnserve import hardware

    real = hardware.is_installed
    monkeypatch.setattr(hardware, "is_installed", lambda name: name in present or (name not in absent and real(name)))


def test_backends_json(capsys, monkeypatch):
    _installed_here(monkeypatch, absent=("flashinfer",))
    d = _json(capsys, ["backends", "--json"])
    assert d["torch_native"]["available"] and d["torch_native"]["reasons"] == []
    assert "cpu" in d["torch_native"]["features"]["devices"]
    assert not d["flashinfer"]["available"]
    assert "package 'flashinfer' is not installed" in d["flashinfer"]["reasons"]
    assert d["nsa"]["alias_of"] == "dsa" and d["compressed"]["alias_of"] == "dsv4"
    assert len(d) == 27
    for entry in d.values():
        assert entry["available"] == (not entry["reasons"])


def test_backends_json_reports_flashinfer_installed_when_it_is(capsys, monkeypatch):
    _installed_here(monkeypatch, present=("flashinfer",))
    d = _json(capsys, ["backends", "--json"])
    assert not any("not installed" in r for r in d["flashinfer"]["reasons"])


def test_backends_for_a_hypothetical_gpu(capsys):
    d = _json(capsys, ["backends", "--gpu", "h100", "--json"])
    assert d["fa3"]["reasons"] == ["not implemented in attnserve (known from SGLang)"]
    assert d["fa4"]["reasons"] == []  # FA4 runs on Hopper (a hypothetical machine has every package)
    assert any("SM100" in r for r in d["trtllm_mla"]["reasons"])


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "torch_native" in out and "nsa (= dsa)" in out and "run here" in out
