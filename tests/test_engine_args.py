"""The engine's flags come from EngineConfig's fields: every flag the hand-written parser had still parses,
with the same default, to the same config value; `tune` reads the same declarations."""

import argparse
import dataclasses

import pytest

from attnserve.cli import build_parser
from attnserve.commands.engine_args import add_engine_arguments, engine_config, engine_knobs
from attnserve.engine.config import EngineConfig

# The engine flags of `generate` and `serve` before they were built from EngineConfig:
# (option strings, EngineConfig field, default, a value given on the command line, the config value it gives)
OLD_ENGINE_FLAGS = [
    (("--model", "--model-path"), "model", None, "/models/x", "/models/x"),
    (("--tp-size", "--tensor-parallel-size"), "tp_size", 1, "1", 1),
    (("--nnodes",), "nnodes", 1, "1", 1),
    (("--node-rank",), "node_rank", 0, "0", 0),
    (("--dist-init-addr",), "dist_init_addr", None, "10.0.0.1:5000", "10.0.0.1:5000"),
    (("--random-weights",), "random_weights", False, None, True),
    (("--attention-backend",), "attention_backend", None, "triton", "triton"),
    (("--prefill-attention-backend",), "prefill_attention_backend", None, "torch_native", "torch_native"),
    (("--decode-attention-backend",), "decode_attention_backend", None, "flashinfer", "flashinfer"),
    (("--no-tuned",), "no_tuned", False, None, True),
    (("--device",), "device", "auto", "cuda:1", "cuda:1"),
    (("--dtype",), "dtype", "auto", "bf16", "bf16"),
    (("--weights-dtype",), "weights_dtype", "auto", "int4", "int4"),
    (("--cpu-threads",), "cpu_threads", None, "3", 3),
    (("--kv-cache-dtype",), "kv_cache_dtype", "auto", "fp8_e4m3", "fp8_e4m3"),
    (("--page-size",), "page_size", None, "16", 16),
    (("--max-running-requests",), "max_running_requests", 64, "8", 8),
    (("--max-total-tokens",), "max_total_tokens", None, "4096", 4096),
    (("--mem-fraction-static",), "mem_fraction_static", 0.85, "0.5", 0.5),
    (("--max-prefill-tokens",), "max_prefill_tokens", 16384, "512", 512),
    (("--context-length",), "max_context_len", None, "1024", 1024),
    (("--chunked-prefill-size",), "chunked_prefill_size", 2048, "-1", -1),
    (("--max-num-batched-tokens",), "max_num_batched_tokens", None, "1024", 1024),
    (("--schedule-policy",), "schedule_policy", "fcfs", "lpm", "lpm"),
    (("--disable-radix-cache",), "disable_radix_cache", False, None, True),
    (("--disable-cuda-graph",), "disable_cuda_graph", False, None, True),
    (("--disable-overlap-schedule",), "disable_overlap_schedule", False, None, True),
    (("--enable-deterministic-inference",), "enable_deterministic_inference", False, None, True),
    (("--cuda-graph-max-bs",), "cuda_graph_max_bs", None, "32", 32),
    (("--disable-piecewise-cuda-graph",), "disable_piecewise_cuda_graph", False, None, True),
    (("--piecewise-cuda-graph-max-tokens",), "piecewise_cuda_graph_max_tokens", None, "1024", 1024),
    (("--disable-fused-ops",), "disable_fused_ops", False, None, True),
    (("--enable-pdl",), "enable_pdl", False, None, True),
    (("--speculative-algorithm",), "speculative_algorithm", None, "NGRAM", "ngram"),
    (("--speculative-num-draft-tokens",), "speculative_num_draft_tokens", 4, "6", 6),
    (("--speculative-num-steps",), "speculative_num_steps", None, "3", 3),
    (("--speculative-eagle-topk",), "speculative_eagle_topk", 1, "2", 2),
    (("--speculative-ngram-min-match-window-size",), "speculative_ngram_min_match_window_size", 2, "1", 1),
    (("--speculative-ngram-max-match-window-size",), "speculative_ngram_max_match_window_size", 12, "8", 8),
    (("--speculative-attention-mode",), "speculative_attention_mode", "prefill", "decode", "decode"),
]
COMMAND = {"generate": ["generate", "hi"], "serve": ["serve"]}
IMPLIED = {"enable_deterministic_inference": {"chunked_prefill_size", "disable_radix_cache"}}  # the mode sets them


def _parse(argv):
    return engine_config(build_parser().parse_args(argv))


@pytest.mark.parametrize("command", sorted(COMMAND))
def test_defaults_are_the_old_parsers(command):
    config = _parse(COMMAND[command])
    for _, field, default, _, _ in OLD_ENGINE_FLAGS:
        assert getattr(config, field) == default, field
    assert config == EngineConfig()  # the command line's defaults are the config's


@pytest.mark.parametrize("command", sorted(COMMAND))
@pytest.mark.parametrize("flags,field,default,text,value", OLD_ENGINE_FLAGS, ids=[f[0][0] for f in OLD_ENGINE_FLAGS])
def test_every_old_flag_parses_to_the_same_config_value(command, flags, field, default, text, value):
    for flag in flags:
        config = _parse([*COMMAND[command], flag] + ([] if text is None else [text]))
        assert getattr(config, field) == value, flag
        others = {f.name for f in dataclasses.fields(EngineConfig)} - {field} - IMPLIED.get(field, set())
        assert all(getattr(config, name) == getattr(EngineConfig(), name) for name in others), flag


def test_the_knobs_are_exactly_the_old_flags():
    """No flag lost, none added by accident: each knob is one old flag set, in the old help order."""
    assert [f.metadata["flags"] for f in engine_knobs()] == [flags for flags, *_ in OLD_ENGINE_FLAGS]
    assert "seed" not in {f.name for f in engine_knobs()}  # set from Python only (generate's --seed samples)


def test_a_bad_backend_name_is_refused_by_the_config():
    with pytest.raises(ValueError, match="no-such-backend"):
        _parse(["serve", "--attention-backend", "no-such-backend"])


def test_the_step_budget_flag_takes_a_number_auto_or_auto_with_its_scale():
    assert _parse(["serve", "--max-num-batched-tokens", "auto"]).max_num_batched_tokens == "auto"
    assert _parse(["serve", "--max-num-batched-tokens", "auto:32768"]).max_num_batched_tokens == "auto:32768"
    assert _parse(["serve", "--max-num-batched-tokens", "-1"]).max_num_batched_tokens == -1
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a number, auto or auto:S"):
        _parse(["serve", "--max-num-batched-tokens", "lots"])
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert "--max-num-batched-tokens N|auto[:S]" in " ".join(sub.choices["serve"].format_help().split())


def test_tune_takes_the_engine_declarations_with_its_own_model_default():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    tune = sub.choices["tune"]
    args = tune.parse_args(["--tensor-parallel-size", "2", "--kv-cache-dtype", "bf16", "--page-size", "16"])
    assert (args.model, args.tp_size, args.kv_cache_dtype, args.page_size) == ("smollm2-135m", 2, "bf16", 16)
    assert tune.parse_args(["--model-path", "x.gguf"]).model == "x.gguf"
    assert tune.parse_args([]).tp_size == 1 and tune.parse_args([]).page_size is None


def test_overrides_replace_one_setting_of_one_flag():
    p = argparse.ArgumentParser()
    add_engine_arguments(p, only=("page_size",), overrides={"page_size": {"default": 64}})
    assert vars(p.parse_args([])) == {"page_size": 64}
    assert p.parse_args(["--page-size", "8"]).page_size == 8


def test_help_names_each_value_as_before():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["serve"].format_help().split())
    for shown in ("--context-length CONTEXT_LENGTH", "--model MODEL, --model-path MODEL", "--dist-init-addr HOST:PORT",
                  "--attention-backend NAME", "--weights-dtype {auto,dequantized,int4}", "--random-weights "):
        assert shown in text, shown
