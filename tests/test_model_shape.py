"""One resolver from a model name to the attention shape a tensor-parallel rank sees: `select`, `kv-calc`,
`tune` and the loaded model's `kv_cache_spec()` all answer through `attention_shape_of`."""

import argparse
import dataclasses
import json

import pytest

from attnserve.cli import main
from attnserve.commands import select, tune
from attnserve.models.config import ModelConfig, attention_shape_of
from attnserve.models.gguf_loader import GGUFFile
from attnserve.models.loader import embedded_model_path
from attnserve.presets import load_model_config


def test_preset_config_file_and_parsed_config_give_one_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_model_config("llama-3-8b")))
    by_preset = attention_shape_of("llama-3-8b", tp_size=2)
    assert (by_preset.num_q_heads, by_preset.num_kv_heads, by_preset.name) == (16, 4, "llama-3-8b")
    for other in (attention_shape_of(tmp_path, 2), attention_shape_of(tmp_path / "config.json", 2),
                  attention_shape_of(ModelConfig.load("llama-3-8b"), 2)):
        assert dataclasses.replace(other, name="") == dataclasses.replace(by_preset, name="")
    assert attention_shape_of(ModelConfig.load("llama-3-8b")).name == ""  # a parsed config is unnamed


@pytest.mark.needs_embedded_model
def test_a_gguf_file_is_read_for_its_shape():
    path = embedded_model_path()
    shape = attention_shape_of(path)
    expected = ModelConfig.from_hf(GGUFFile(path).hf_config(), str(path)).attention_shape(name=str(path))
    assert shape == expected and shape.num_q_heads == 9 and shape.num_kv_heads == 3
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        attention_shape_of("missing.gguf")


@pytest.mark.needs_embedded_model
def test_select_tune_and_kv_calc_resolve_alike(capsys):
    path = str(embedded_model_path())
    args = argparse.Namespace(model=path, tp_size=3, attention_sinks=False, sliding_window=None,
                              logit_softcap=None, v_head_dim=None)
    by_select = select.model_from_args(args)
    by_tune, max_context = tune._shape(path, 3)
    assert by_select == by_tune == attention_shape_of(path, 3) and by_select.num_q_heads == 3
    assert max_context == ModelConfig.load(path).max_position_embeddings
    assert main(["kv-calc", "--model", path, "--context", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_q_heads"], report["num_kv_heads"]) == (9, 3)
