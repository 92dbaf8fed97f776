"""GGUF files written here from tiny transformers models: q/k un-permutation, Qwen3 names, quant types.

llama.cpp's converter permutes the q/k rows of `llama` models for its RoPE kernel
(and leaves `qwen3` alone); the files below are written the same way, so loading
them back must reproduce the transformers model's logits.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from engine_runs import max_rel_err, run_engine

from attnserve.models.loader import load_model

VOCAB = 96
_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of `llama` models (pairs interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


def _write_gguf(hf, arch: str, path, qtype: str) -> None:
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = _llama_cpp_permute(a, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if a.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _round_trip_weights(hf, qtype: str) -> None:
    """Give the reference the same quantisation error the file carries."""
    if qtype == "F32":
        return
    q = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                a = p.numpy().astype(np.float32)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, q), q).reshape(a.shape)))


CASES = [
    ("llama", "Llama", "F32", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    ("llama", "Llama", "Q8_0", {"num_key_value_heads": 4, "tie_word_embeddings": False}),
    ("qwen3", "Qwen3", "F16", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    ("llama", "Llama", "Q4_0", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
]


@pytest.mark.parametrize(("arch", "family", "qtype", "extra"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_written_gguf_matches_transformers(arch, family, qtype, extra, tmp_path):
    torch.set_num_threads(1)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5, **extra)
    torch.manual_seed(7)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    _write_gguf(hf, arch, path, qtype)
    _round_trip_weights(hf, qtype)
    lm = load_model(path, dtype=torch.float32)
    assert lm.format == "gguf" and lm.tokenizer is None
    assert lm.config.tie_word_embeddings == extra["tie_word_embeddings"]
    prompt = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    run, = run_engine(lm, [prompt], 8)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + run.token_ids[:-1]])).logits[0, len(prompt) - 1 :]  # [8, vocab]
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    rel = max_rel_err(run.logits, ref)  # the prefill's and every decode step's
    assert rel < 1e-4, f"max relative error {rel:.2e}"
    assert run.token_ids == expected


# the toy sentencepiece vocabulary's scored pieces, best score first; their ids follow <unk>, <s>, </s> and
# the 256 byte tokens
SP_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "t", "\u2581h", "he", "ll", "llo", "\u2581he",
             "\u2581hello", "\u2581w", "or", "orld", "\u2581world", "\u2581t", "\u2581the", "th", "\u2581wor",
             "ld", "\u2581\u2581", "lo", "\u2581th"]
SP_ID = {piece: 3 + 256 + i for i, piece in enumerate(SP_PIECES)}
SP_BOS, SP_EOS = 1, 2


def _sentencepiece_gguf(path, add_bos_token: bool | None = None, add_space_prefix: bool | None = None) -> None:
    """A metadata-only GGUF with a toy sentencepiece vocabulary: specials, 256 byte tokens, scored pieces.

    add_bos_token / add_space_prefix: written as tokenizer.ggml.add_bos_token / add_space_prefix; None
    leaves the key out.
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SP_PIECES))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(SP_BOS)
    w.add_eos_token_id(SP_EOS)
    w.add_unk_token_id(0)
    if add_bos_token is not None:
        w.add_add_bos_token(add_bos_token)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _sentencepiece_tokenizer(tmp_path, **metadata):
    from attnserve.models.gguf_loader import GGUFFile
    from attnserve.models.tokenizer import Tokenizer

    path = tmp_path / "sp.gguf"
    _sentencepiece_gguf(path, **metadata)
    return Tokenizer.from_gguf(GGUFFile(path).tokenizer_fields(), str(path)), path


# What a GGUF's sentencepiece ("llama") vocabulary means is llama.cpp's reading of its metadata:
# tokenizer.ggml.add_bos_token (default true) puts BOS first, and tokenizer.ggml.add_space_prefix (default
# true) puts one '▁' before the text and before the text after each special token, also where the text
# already starts with a space. These are asserted as such; transformers' GGUF import has changed its mind
# on both across versions (5.17 adds no BOS and prefixes as llama.cpp does; 5.24 adds BOS and prefixes only
# text that does not start with a space, and only at the start), so it is compared only on texts where
# those versions agree.
TEXTS_TRANSFORMERS_VERSIONS_AGREE_ON = ["hello world", "the worldé!", "\nhe\tllo", "x"]


@pytest.mark.parametrize("add_bos_token,starts_with_bos", [(None, True), (True, True), (False, False)])
def test_sentencepiece_gguf_tokenizer_follows_llama_cpp_and_matches_transformers(tmp_path, add_bos_token,
                                                                                 starts_with_bos):
    ours, path = _sentencepiece_tokenizer(tmp_path, add_bos_token=add_bos_token)
    bos = [SP_BOS] if starts_with_bos else []
    p = SP_ID
    # one '▁' in front of the text; a leading space of the text's own stays a '▁' of its own
    assert ours.encode("hello world") == bos + [p["\u2581hello"], p["\u2581world"]]
    assert ours.encode(" hello  the world") == bos + [p["\u2581"], p["\u2581hello"], p["\u2581"], p["\u2581the"],
                                                      p["\u2581world"]]
    # the text after a special token is prefixed again
    assert ours.encode("hello</s>world") == bos + [p["\u2581hello"], SP_EOS, p["\u2581world"]]
    for text in [" hello  the world", "hello world", "  x", "the worldé!", "\nhe\tllo"]:
        assert ours.decode(ours.encode(text)) == text  # the prefix is dropped again, the text's spaces kept
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS_TRANSFORMERS_VERSIONS_AGREE_ON:
        ids = ours.encode(text)
        assert (ids[0] == SP_BOS) == starts_with_bos and ids.count(SP_BOS) == int(starts_with_bos), (text, ids)
        body = ids[1:] if starts_with_bos else ids
        assert body == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == body, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_gguf_without_a_space_prefix_tokenizes_the_text_as_it_is(tmp_path):
    """tokenizer.ggml.add_space_prefix = false: no '▁' is added, so "hello" is not the piece "▁hello"."""
    ours, _ = _sentencepiece_tokenizer(tmp_path, add_bos_token=False, add_space_prefix=False)
    p = SP_ID
    assert ours.encode("hello world") == [p["he"], p["llo"], p["\u2581world"]]
    assert ours.encode(" hello") == [p["\u2581hello"]]
    assert ours.encode("hello</s>world") == [p["he"], p["llo"], SP_EOS, p["w"], p["orld"]]
    for text in ["hello world", " hello  the world"]:
        assert ours.decode(ours.encode(text)) == text
