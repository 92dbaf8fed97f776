"""`attnserve tune` on the CPU with a tiny model, and selection reading what it wrote.

One quick tune run (torch_native against flex_attention, a few seconds) is shared by the
module; each test copies its result into its own cache directory and edits the copy.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnserve import hardware
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.choice.tuned import RESULT_KIND, find_tuned
from attnserve.cli import main
from attnserve.hardware import detect_hardware
from attnserve.models.config import ModelConfig

# 4 query / 2 KV heads of width 16: the shape of tests/engine_helpers.tiny_llama
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024}


@pytest.fixture(scope="module", autouse=True)
def on_a_machine_without_a_gpu():
    """These tests describe tune on the CPU: on a GPU machine too, detection (tune, select, the engine's
    device "auto") sees only the CPU, so results, keys and machine names are the CPU's. A CPU without hardware
    bf16, whatever this one has: "auto" is fp32 there (tests/test_auto_dtypes.py covers the other kind)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.setattr(torch.backends.mps, "is_available", lambda: False)
        mp.setattr(hardware, "cpu_has_hardware_bf16", lambda: False)
        yield


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(config.json path, the result file, the JSON `tune --json` printed)."""
    root = tmp_path_factory.mktemp("tune")
    cfg = root / "config.json"
    cfg.write_text(json.dumps(TINY))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNSERVE_CACHE_DIR", str(root / "cache"))
        out = io.StringIO()
        mp.setattr(sys, "stdout", out)
        assert main(["tune", "--model", str(cfg), "--quick", "--json"]) == 0
    files = list((root / "cache").iterdir())
    assert len(files) == 1 and files[0].name.startswith("tune-")  # the progress checkpoint is gone
    return cfg, files[0], json.loads(out.getvalue())


@pytest.fixture
def cache(tuned, tmp_path, monkeypatch):
    """A cache directory of this test's own holding a copy of the tune result; returns the copy's path."""
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    return shutil.copy(tuned[1], tmp_path / tuned[1].name)


def _read(path) -> dict:
    return json.loads(Path(path).read_text())


def _edit(path, **changes):
    data = {**_read(path), **changes}
    Path(path).write_text(json.dumps(data))
    return data


def _select(capsys, cfg, *argv):
    assert main(["select", "--model", str(cfg), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_tune_writes_a_well_formed_result(tuned):
    _, path, printed = tuned
    stored = json.loads(path.read_text())
    assert stored == printed
    hw = detect_hardware()
    assert stored["kind"] == RESULT_KIND and stored["machine"] == hw.name and stored["machine_detail"]
    assert {"torch", "attnserve"} <= set(stored["versions"]) and stored["date"]
    assert stored["shape"]["num_q_heads"] == 4 and stored["shape"]["num_kv_heads"] == 2
    assert stored["shape"]["head_dim"] == 16 and stored["shape"]["kv_cache_dtype"] == "fp32"
    assert any("triton not raced" in n for n in stored["notes"])  # said, not silently dropped
    assert stored["ceilings"]["copy_tbps"] > 0 and stored["ceilings"]["matmul_tflops"] > 0
    workloads = {r["workload"] for r in stored["records"]}
    assert {w.split()[0] for w in workloads} == {"decode", "prefill"}
    for rec in stored["records"]:
        assert rec["backend"] in ("torch_native", "flex_attention"), rec
        assert rec["checked_against"] == "oracle" and rec["rel_err"] < 1e-3, rec  # checked before timing
        assert rec["us"] > 0 and rec["timing"] == "cpu" and "pct_of_ceiling" in rec, rec
    assert {len([r for r in stored["records"] if r["workload"] == w]) for w in workloads} == {2}
    for side in ("prefill", "decode"):
        w = stored["winners"][side]
        assert w["backend"] in ("torch_native", "flex_attention") and w["runner_up"] != w["backend"]
        assert w["ratio"] >= 1.0


def test_select_cites_the_result_and_picks_its_winner(tuned, cache, capsys):
    cfg = tuned[0]
    out = _select(capsys, cfg)
    winners = tuned[2]["winners"]
    assert (out["prefill_backend"], out["decode_backend"]) == (winners["prefill"]["backend"],
                                                               winners["decode"]["backend"])
    cited = [e for e in out["trace"] if e["kind"] == "tuned" and e["side"] == "decode"]
    assert len(cited) == 1 and str(cache) in cited[0]["reason"] and tuned[2]["date"] in cited[0]["reason"]
    assert f"{winners['decode']['ratio']:.2f}x faster than {winners['decode']['runner_up']}" in cited[0]["reason"]
    # the measured winner decides, not the static order: make flex_attention the decode winner
    _edit(cache, winners={**winners, "decode": {"backend": "flex_attention", "runner_up": "torch_native",
                                                "ratio": 1.5}})
    out = _select(capsys, cfg)
    assert out["decode_backend"] == "flex_attention" and out["prefill_backend"] == winners["prefill"]["backend"]
    # --no-tuned: the policy alone, and the trace says nothing was read
    out = _select(capsys, cfg, "--no-tuned")
    assert out["decode_backend"] == "torch_native"
    assert not any(e["kind"] == "tuned" for e in out["trace"])
    # an explicit backend is never replaced by a measured one
    out = _select(capsys, cfg, "--attention-backend", "torch_native")
    assert out["decode_backend"] == "torch_native" and not any(e["kind"] == "tuned" for e in out["trace"])


def test_other_versions_are_stale_reported_and_not_used(tuned, cache, capsys):
    versions = _read(cache)["versions"]
    _edit(cache, versions={**versions, "torch": "1.0.0"},
          winners={"decode": {"backend": "flex_attention", "runner_up": None, "ratio": None}})
    out = _select(capsys, tuned[0])
    assert out["decode_backend"] == "torch_native"  # the policy's, not the stale winner
    stale = [e["reason"] for e in out["trace"] if e["kind"] == "tuned"]
    assert len(stale) == 1 and "stale" in stale[0] and str(cache) in stale[0]
    assert f"torch 1.0.0 -> {versions['torch']}" in stale[0]


def test_other_shapes_and_machines_do_not_match(tuned, cache):
    shape = ModelConfig.load(tuned[0]).attention_shape()
    hw = detect_hardware()
    assert find_tuned(hw, shape, "fp32", None)[0] is not None
    assert find_tuned(hw, shape, "bf16", None)[0] is None  # another KV dtype
    assert find_tuned(hw, shape, "fp32", 16)[0] is None  # another page size
    _edit(cache, machine="some other machine")
    choice, notes = find_tuned(hw, shape, "fp32", None)
    assert choice is None and "1 for other machines or shapes" in notes[0]


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00binary", b"[1, 2]", b'{"kind": "attnserve-tune"}'],
                         ids=["corrupt", "binary", "not-an-object", "missing-fields"])
def test_a_broken_cache_file_is_reported_and_ignored(tuned, cache, content):
    bad = cache.parent / "tune-broken.json"
    bad.write_bytes(content)
    (cache.parent / "tune-a-directory.json").mkdir()  # unreadable as a file
    shape = ModelConfig.load(tuned[0]).attention_shape()
    hw = detect_hardware()
    sel = select_backends(hw, shape, ServingFeatures(kv_cache_dtype="fp32"), use_tuned=True)
    reasons = [e.reason for e in sel.trace if e.kind == "tuned"]
    assert any(str(bad) in r and "ignored unreadable" in r for r in reasons)
    assert any("tune-a-directory.json" in r and "ignored unreadable" in r for r in reasons)
    assert any("measured fastest" in r for r in reasons)  # the good file next to them still counts


def test_the_engine_prefers_the_tuned_winner_unless_told_not_to(tuned, cache):
    from engine_helpers import tiny_llama

    from attnserve.engine.llm import LLM

    winners = _read(cache)["winners"]
    _edit(cache, winners={**winners, "prefill": {"backend": "flex_attention", "runner_up": "torch_native",
                                                 "ratio": 1.2}})
    llm = LLM(loaded=tiny_llama(), device="cpu", max_total_tokens=256)
    attention = llm.engine.parts.attention
    assert attention.prefill_backend == "flex_attention"
    assert any(str(cache) in line for line in attention.trace)
    llm = LLM(loaded=tiny_llama(), device="cpu", max_total_tokens=256, no_tuned=True)
    assert llm.engine.parts.attention.prefill_backend == "torch_native"


def test_generate_and_serve_take_no_tuned():
    from attnserve.cli import build_parser
    from attnserve.commands.engine_args import engine_config

    for cmd in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*cmd, "--no-tuned"])
        assert engine_config(args).no_tuned is True
        assert engine_config(build_parser().parse_args(cmd)).no_tuned is False


def test_tune_refuses_what_it_cannot_race(tuned, capsys):
    assert main(["tune", "--model", str(tuned[0]), "--backends", "fa3"]) == 2
    assert "'fa3' is not implemented" in capsys.readouterr().err
    assert main(["tune", "--model", str(tuned[0]), "--kv-cache-dtype", "fp8_e4m3"]) == 2
    assert "fp8_e4m3" in capsys.readouterr().err


def test_tune_baseline_names_every_slowed_workload(tuned, tmp_path, monkeypatch, capsys):
    """A stored run whose times are made 100x faster: every workload this run times is slower than it allows."""
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    old = json.loads(tuned[1].read_text())
    for rec in old["records"]:
        rec["us"] /= 100
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["tune", "--model", str(tuned[0]), "--quick", "--baseline", str(tmp_path / "old.json")]) == 3
    out = capsys.readouterr().out
    for rec in old["records"]:
        assert f"{rec['workload']} / {rec['backend']}" in out
    # another machine's run is refused before racing
    (tmp_path / "other.json").write_text(json.dumps({**old, "machine": "NVIDIA H200"}))
    assert main(["tune", "--model", str(tuned[0]), "--quick", "--baseline", str(tmp_path / "other.json")]) == 2
    assert "measured on 'NVIDIA H200'" in capsys.readouterr().err


def test_triton_on_the_cpu_needs_the_interpreter(tuned, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by conftest on machines without CUDA only
    assert main(["tune", "--model", str(tuned[0]), "--backends", "triton"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


# DeepSeek's MLA scaled down: 4 query heads over a latent of 32 + rope 16, contexts capped at 128
TINY_MLA = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


def test_tune_races_an_mla_model_on_its_latent_and_select_cites_it(tmp_path, monkeypatch, capsys):
    """flex_attention serves no MLA pool and triton needs the interpreter: torch_native races alone on the CPU,
    on the model's own latent, checked against the oracle; select then cites the result for that shape."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MLA))
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["tune", "--model", str(cfg), "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    shape = result["shape"]
    assert shape["attention"] == "MLA" and shape["kv_lora_rank"] == 32 and shape["qk_rope_head_dim"] == 16
    assert (shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], shape["v_head_dim"]) == (4, 1, 48, 32)
    assert any("MLA prefill raced as chunks over a cached prefix" in n for n in result["notes"])
    names = [r["workload"] for r in result["records"]]
    # quick CPU grid: decode batches 1 and 4 at the model's longest context; the prefill as two 64-token chunks
    assert names == ["mla decode 1x128 h4 p1", "mla decode 4x128 h4 p1", "mla extend 1x(64+64) h4 p1"]
    for rec in result["records"]:
        assert rec["backend"] == "torch_native", rec
        assert rec["checked_against"] == "oracle" and rec["rel_err"] < 1e-3, rec
        assert rec["us"] > 0 and "tflops" in rec and "pct_of_ceiling" in rec, rec
    assert {side: w["backend"] for side, w in result["winners"].items()} == {"prefill": "torch_native",
                                                                            "decode": "torch_native"}
    out = _select(capsys, cfg)
    cited = [e["reason"] for e in out["trace"] if e["kind"] == "tuned"]
    assert len(cited) == 2 and all("the only backend raced" in r and "-mla4x1-d48v32-" in r for r in cited)
    # a page size other than the tuned one is another shape: not cited
    out = _select(capsys, cfg, "--page-size", "16")
    assert not any("measured fastest" in e["reason"] for e in out["trace"] if e["kind"] == "tuned")


def test_mla_workloads_follow_the_model_shape():
    from attnserve.bench.tune import mla_shape_of, workloads_for

    shape = ModelConfig.load("deepseek-v2-lite").attention_shape()
    mla = mla_shape_of(shape)
    assert (mla.num_heads, mla.kv_lora_rank, mla.rope_dim) == (16, 512, 64)
    ws = workloads_for("cuda", False, 64, 163840, mla)
    assert all(w.mla == mla and w.page_size == 64 and w.name.startswith("mla ") for w in ws)
    assert {w.kind for w in ws} == {"decode", "extend"} and all(w.prefix > 0 for w in ws)
    assert "mla decode 64x4096 h16 p64" in {w.name for w in ws}
    # a context shorter than every chunk still races one chunk over a prefix
    assert [(w.prefix, w.new_tokens) for w in workloads_for("cpu", True, 1, 40, mla) if w.kind == "extend"] == [(20, 20)]
    assert mla_shape_of(ModelConfig.from_hf(TINY).attention_shape()) is None


def test_tune_races_triton_mla_on_the_cpu_interpreter_in_a_fresh_process(tmp_path):
    """`attnserve tune --backends triton` under TRITON_INTERPRET=1, in a process without this suite's conftest:
    the MLA kernels' loop bounds are loaded scalars, which Triton 3.6's interpreter cannot index with under
    numpy >= 2.4 unless the backend lets it (kernels/interpreter_compat.py). Triton is checked and timed."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MLA))
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATTNSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "CUDA_VISIBLE_DEVICES": "",  # the CPU's race (its workloads), also on a machine with a GPU
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    # fp32 KV, as "auto" gives on a CPU without hardware bf16 (this process's mock does not reach that one)
    done = subprocess.run([sys.executable, "-m", "attnserve", "tune", "--model", str(cfg), "--quick", "--json",
                           "--kv-cache-dtype", "fp32", "--backends", "triton", "torch_native"], env=env,
                          capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [r for r in json.loads(done.stdout)["records"] if r["backend"] == "triton"]
    assert [r["workload"] for r in records] == ["mla decode 1x128 h4 p1", "mla decode 4x128 h4 p1",
                                                "mla extend 1x(64+64) h4 p1"]
    for rec in records:
        assert "skipped" not in rec and rec["checked_against"] == "oracle" and rec["rel_err"] < 1e-3, rec
        assert rec["us"] > 0, rec
