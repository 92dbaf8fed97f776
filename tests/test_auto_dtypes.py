"""One answer for "auto": `attnserve select`, `kv-calc` and `tune` resolve the model and KV dtypes as the engine does.

The CPU's hardware bf16 (AMX / AVX512-BF16) is mocked both ways; select describes this machine, and the engine
loads the same config.json (random weights) on it.
"""

import json

import pytest
import torch
from engine_helpers import VOCAB

from attnserve import hardware
from attnserve.cli import main
from attnserve.dtypes import resolve_dtypes
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.hardware import PRESET_HARDWARE


def _config(tmp_path, torch_dtype: str | None):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    if torch_dtype:
        cfg["torch_dtype"] = torch_dtype
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture
def cpu_machine(monkeypatch):
    """This machine as a CPU-only one (on a GPU machine `select` and `tune` would describe the GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _serving_line(trace: list[str]) -> str:
    (line,) = [t for t in trace if "serving:" in t]
    return line[line.index("serving:"):]


@pytest.mark.parametrize("cpu_bf16", [True, False], ids=["amx", "no-hardware-bf16"])
@pytest.mark.parametrize("flags", [(), ("--kv-cache-dtype", "fp16"), ("--dtype", "fp32")],
                         ids=["auto", "kv-fp16", "dtype-fp32"])
def test_select_says_what_the_engine_runs_on_this_cpu(monkeypatch, capsys, tmp_path, cpu_bf16, flags, cpu_machine):
    monkeypatch.setattr(hardware, "cpu_has_hardware_bf16", lambda: cpu_bf16)
    path = _config(tmp_path, "float16")  # a GPU would take the checkpoint's fp16; a CPU decides by itself
    sel = _json(capsys, ["select", "--model", str(path), "--json", *flags])
    settings = dict(zip(flags[::2], flags[1::2]))
    engine = Engine(EngineConfig(model=str(path), random_weights=True, device="cpu", max_total_tokens=256,
                                 dtype=settings.get("--dtype", "auto"),
                                 kv_cache_dtype=settings.get("--kv-cache-dtype", "auto")))
    p = engine.parts
    model_dtype = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[p.model.dtype]
    assert (sel["dtype"], sel["kv_cache_dtype"]) == (model_dtype, p.attention.kv_dtype)
    want = "fp32" if flags == ("--dtype", "fp32") else ("bf16" if cpu_bf16 else "fp32")
    assert model_dtype == want
    assert p.attention.kv_dtype == ("fp16" if flags == ("--kv-cache-dtype", "fp16") else want)
    assert p.kv.pool.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[p.attention.kv_dtype]
    # the same trace line, with how each dtype was resolved
    assert _serving_line([e["reason"] for e in sel["trace"]]) == _serving_line(p.attention.trace)
    assert f"KV {p.attention.kv_dtype}" in _serving_line(p.attention.trace)
    assert (sel["prefill_backend"], sel["decode_backend"]) == (p.attention.prefill_backend, p.attention.decode_backend)
    if not flags:
        reason = "in hardware" if cpu_bf16 else "no hardware bf16"
        assert reason in _serving_line(p.attention.trace) and reason in "\n".join(p.startup_lines)


@pytest.mark.parametrize("stated, want", [("float16", "fp16"), ("float32", "fp32"), (None, "bf16")])
def test_a_gpu_takes_the_checkpoints_dtype_in_select_kv_calc_and_the_loader(capsys, tmp_path, stated, want):
    from attnserve.models.loader import resolve_dtype

    path = _config(tmp_path, stated)
    sel = _json(capsys, ["select", "--gpu", "h100", "--model", str(path), "--json"])
    calc = _json(capsys, ["kv-calc", "--model", str(path), "--context", "128", "--json"])
    assert sel["dtype"] == sel["kv_cache_dtype"] == calc["kv_cache_dtype"] == calc["weight_dtype"] == want
    loaded = resolve_dtype("auto", torch.device("cuda"), json.loads(path.read_text()))
    assert resolve_dtypes("cuda", False, loaded).model_name == want
    fp8 = _json(capsys, ["kv-calc", "--model", str(path), "--context", "128", "--kv-cache-dtype", "fp8_e4m3",
                         "--json"])
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and fp8["weight_dtype"] == want


def test_hypothetical_cpus_carry_their_bf16(capsys):
    assert _json(capsys, ["select", "--gpu", "cpu-amx", "--json"])["kv_cache_dtype"] == "bf16"
    assert _json(capsys, ["select", "--gpu", "cpu", "--json"])["kv_cache_dtype"] == "fp32"
    assert PRESET_HARDWARE["cpu-amx"].cpu_bf16 and not PRESET_HARDWARE["arm-cpu"].cpu_bf16


def test_tune_keys_its_results_by_the_kv_dtype_the_engine_runs(monkeypatch, cpu_machine):
    """tune's "auto" is the engine's: a result measured on an AMX CPU is found by the engine there (bf16)."""
    from types import SimpleNamespace

    import attnserve.commands.tune as tune_cmd

    seen = {}

    def stop(hw, shape):
        seen["shape"] = shape
        raise SystemExit(0)

    for cpu_bf16, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(hardware, "cpu_has_hardware_bf16", lambda cpu_bf16=cpu_bf16: cpu_bf16)
        monkeypatch.setattr(tune_cmd, "result_path", stop)
        args = SimpleNamespace(tp_size=1, model="smollm2-135m", kv_cache_dtype="auto", page_size=None, baseline=None)
        with pytest.raises(SystemExit):
            tune_cmd.run(args)
        assert seen["shape"]["kv_cache_dtype"] == want
