"""`attnserve select` through attnserve.cli.main."""

import json

import pytest

from attnserve.cli import main


def _json(capsys, *argv):
    assert main(["select", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hypothetical_gpu_json(capsys):
    out = _json(capsys, "--gpu", "h100", "--model", "llama-3-8b", "--sglang")
    assert (out["prefill_backend"], out["decode_backend"]) == ("fa3", "fa3")
    assert isinstance(out["trace"], list) and any("17411" in e["reason"] for e in out["trace"])
    assert any("every package counts as installed" in e["reason"] for e in out["trace"])


def test_installed_list_limits_the_hypothetical_machine(capsys):
    out = _json(capsys, "--gpu", "h100", "--installed", "")
    assert out["prefill_backend"] == "flex_attention"
    assert any("package 'flashinfer' is not installed" in e["reason"] for e in out["trace"])


def test_model_trait_flags_override_the_config(capsys):
    out = _json(capsys, "--gpu", "l4", "--model", "llama-3-8b", "--attention-sinks", "--sglang")
    assert out["decode_backend"] == "triton"
    out = _json(capsys, "--gpu", "b200", "--model", "llama-3-8b", "--v-head-dim", "64", "--sglang")
    assert (out["prefill_backend"], out["page_size"]) == ("fa4", 128)


def test_config_json_path(capsys, tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = _json(capsys, "--gpu", "b200", "--model", str(path), "--sglang")
    assert out["decode_backend"] == "trtllm_mla" and out["page_size"] == 64


def test_this_machine_by_default(capsys):
    out = _json(capsys)
    assert out["trace"][0]["reason"].startswith("hardware:")
    assert "installed:" in out["trace"][0]["reason"]  # real machine: what is installed was checked


def test_text_output(capsys):
    assert main(["select", "--gpu", "mi300", "--sglang"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("prefill: ") and "policy" in text and "aiter" in text


@pytest.mark.parametrize("argv,words", [
    (["--gpu", "b200", "--speculative-topk", "2", "--attention-backend", "trtllm_mha", "--sglang"],
     "no speculative topk > 1"),
    (["--gpu", "l4", "--attention-sinks", "--attention-backend", "flashinfer"], "no attention sinks"),
    (["--installed", "triton"], "add --gpu"),
    (["--gpu", "h100", "--model", "no-such-model"], "neither a preset"),
    (["--gpu", "h100", "--page-size", "3"], "power of two"),
    (["--gpu", "h100", "--attention-backend", "nonsense"], "valid names"),
])
def test_impossible_requests_exit_non_zero_with_reason_on_stderr(capsys, argv, words):
    assert main(["select", *argv, "--json"]) != 0
    captured = capsys.readouterr()
    assert words in captured.err and captured.out == ""
