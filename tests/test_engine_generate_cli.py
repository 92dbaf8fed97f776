"""`attnserve generate` flags: SGLang's names, what reaches EngineConfig, and clear refusals (no model is loaded)."""

import pytest

from attnserve.choice.registry import REGISTRY
from attnserve.cli import build_parser, main
from attnserve.commands import generate
from attnserve.engine.config import EngineConfig


class _Captured(Exception):
    pass


@pytest.fixture
def engine_settings(monkeypatch):
    """The EngineConfig `generate` builds the LLM with, as a dict; the run stops there."""
    seen = {}

    def fake_llm(*, config):
        assert isinstance(config, EngineConfig)
        seen.update(vars(config))
        raise _Captured

    monkeypatch.setattr(generate, "LLM", fake_llm)
    return seen


def test_model_path_is_an_alias_and_prefill_budget_reaches_the_engine(engine_settings):
    with pytest.raises(_Captured):
        main(["generate", "hi", "--quiet", "--model-path", "/models/x", "--max-prefill-tokens", "512",
              "--tp-size", "1"])
    assert engine_settings["model"] == "/models/x"
    assert engine_settings["max_prefill_tokens"] == 512


def test_tensor_parallel_flags_reach_the_engine(engine_settings):
    with pytest.raises(_Captured):
        main(["generate", "hi", "--quiet", "--tp-size", "4", "--nnodes", "2", "--node-rank", "0",
              "--dist-init-addr", "10.0.0.1:5000"])
    assert (engine_settings["tp_size"], engine_settings["nnodes"], engine_settings["node_rank"],
            engine_settings["dist_init_addr"]) == (4, 2, 0, "10.0.0.1:5000")


def test_help_names_the_backends_and_reads_as_plain_text():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices["generate"]
    text = parser.format_help()
    assert not parser.description.startswith("`")
    for name, spec in REGISTRY.items():
        if spec.implemented:
            assert name in text, name
    for flag in ("--kv-cache-dtype", "--page-size", "--max-running-requests", "--mem-fraction-static",
                 "--attention-backend", "--max-prefill-tokens"):
        action = next(a for a in parser._actions if flag in a.option_strings)
        assert action.help, flag
    assert "mps" in next(a for a in parser._actions if "--device" in a.option_strings).help


def test_weights_dtype_flag_reaches_the_engine_and_is_explained(engine_settings):
    with pytest.raises(_Captured):
        main(["generate", "hi", "--quiet", "--weights-dtype", "int4", "--dtype", "bf16"])
    assert engine_settings["weights_dtype"] == "int4" and engine_settings["dtype"] == "bf16"
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["generate"].format_help().split())
    assert "--weights-dtype {auto,dequantized,int4}" in text and "AMX" in text
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--weights-dtype", "int3"])
