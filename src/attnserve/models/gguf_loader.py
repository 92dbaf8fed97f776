"""GGUF files: hyper-parameters, tensors and tokenizer from one file.

The metadata is translated into an HF-style config dict so the same ModelConfig
parsing serves both formats; tensor names are mapped to HF names so the same
`load_weights` fills the model. llama.cpp stores the q/k projections of the
`llama` architecture with rows permuted for its interleaved RoPE kernel; they are
permuted back here so the model can use the HF (half-split) layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from attnserve.models.dequant import dequantize
from attnserve.models.gguf_format import read_gguf

# GGUF general.architecture -> HF architecture; which ones llama.cpp stored with permuted q/k rows
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@functools.lru_cache(maxsize=1)
def _read_cached(path: str, mtime_ns: int, size: int):
    """Parsing a GGUF's metadata takes seconds (every vocabulary string is a field part): the start-up checks
    and the load that follows share one parse. Keyed by modification time and size, so a rewritten file is
    parsed again."""
    return read_gguf(path)


class GGUFFile:
    """A parsed GGUF file; `source` (the path) names it in every error."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.source = str(self.path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        stat = self.path.stat()
        self.meta, self.tensor_list = _read_cached(str(self.path.resolve()), stat.st_mtime_ns, stat.st_size)
        self.arch = str(self.value("general.architecture"))
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.source}: unsupported GGUF architecture {self.arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

    def value(self, key: str, default=None):
        return self.meta.get(key, default)

    def _arch(self, key: str, default=None):
        return self.value(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict:
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        tensor_names = {t.name for t in self.tensor_list}
        vocab = self._arch("vocab_size") or len(self.value("tokenizer.ggml.tokens", []))
        cfg = {
            "architectures": [GGUF_ARCHITECTURES[self.arch]],
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": int(self._arch("attention.key_length", 0) or self._arch("rope.dimension_count", 0)
                            or hidden // heads),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._arch("context_length", 4096)),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        }
        rope = {"rope_theta": float(self._arch("rope.freq_base", 10000.0)), "rope_type": "default"}
        scaling = self._arch("rope.scaling.type")
        if scaling in ("linear", "yarn"):
            rope.update(rope_type=scaling, factor=float(self._arch("rope.scaling.factor", 1.0)))
            orig = self._arch("rope.scaling.original_context_length")
            if orig:
                rope["original_max_position_embeddings"] = int(orig)
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.source}: unsupported rope scaling {scaling!r}; supported: linear, yarn")
        cfg["rope_parameters"] = rope
        window = self._arch("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
        return cfg

    def tensors(self, cfg: dict, dtype: torch.dtype) -> Iterator[tuple[str, GGUFSlice]]:
        """(HF name, lazy tensor in dtype) for every tensor, q/k rows un-permuted where needed.

        A tensor-parallel rank dequantises only the slice it narrows to (`GGUFSlice.narrow`)."""
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for t in self.tensor_list:
            if t.name == "rope_freqs.weight":
                continue  # consumed by rope_divisors()
            permuted = self.arch in _PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                                                      "attn_k.bias"))
            row_heads = (heads if ".attn_q." in t.name else kv_heads) if permuted else None
            yield self._hf_name(t.name), GGUFSlice(t, dtype, f"{self.source} [{t.name}]", row_heads)
    def rope_divisors(self) -> torch.Tensor | None:
        """Llama 3.1 GGUFs carry RoPE scaling as per-frequency divisors in `rope_freqs.weight`."""
        for t in self.tensor_list:
            if t.name == "rope_freqs.weight":
                return dequantize(t.data, t.type_name, t.shape, torch.float32, self.source).reshape(-1)
        return None

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        m = _BLOCK.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        raise ValueError(f"{self.source}: unexpected tensor {name!r} for architecture {self.arch}")

    def tokenizer_fields(self) -> dict | None:
        """Vocabulary, merges, token types, special ids and chat template; None when the file has no tokenizer."""
        tokens = self.value("tokenizer.ggml.tokens")
        if tokens is None:
            return None
        return {
            "model": self.value("tokenizer.ggml.model"),
            "pre": self.value("tokenizer.ggml.pre"),
            "tokens": tokens,
            "merges": self.value("tokenizer.ggml.merges", []),
            "scores": self.value("tokenizer.ggml.scores", []),
            "token_type": list(self.value("tokenizer.ggml.token_type", [])),
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
            # sentencepiece vocabularies add BOS unless the file says otherwise (as llama.cpp does)
            "add_bos_token": bool(self.value("tokenizer.ggml.add_bos_token",
                                             self.value("tokenizer.ggml.model") == "llama")),
            # llama.cpp prefixes a sentencepiece vocabulary's text (and the text after each special token) with
            # one space unless the file says otherwise
            "add_space_prefix": bool(self.value("tokenizer.ggml.add_space_prefix",
                                                self.value("tokenizer.ggml.model") == "llama")),
            "chat_template": self.value("tokenizer.chat_template"),
        }


class GGUFSlice:
    """One GGUF tensor, dequantised only as far as it is read.

    Rows (dim 0) are whole quantisation blocks apart, so a row range decodes just those rows; a column
    range (dim 1) decodes just its blocks when it starts and ends on a block edge. `row_heads`: the
    rows are llama.cpp-permuted heads of this many (a row range then covers whole heads).
    """

    def __init__(self, tensor, dtype: torch.dtype, source: str, row_heads: int | None = None):
        self.t = tensor
        self.shape = tensor.shape
        self.dtype = dtype
        self.source = source
        self.row_heads = row_heads

    def _decode(self, raw, shape) -> torch.Tensor:
        return dequantize(raw, self.t.type_name, shape, self.dtype, self.source)

    def read(self) -> torch.Tensor:
        w = self._decode(self.t.data, self.shape)
        return unpermute_rows(w, self.row_heads) if self.row_heads else w

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        data, shape = self.t.data, self.shape
        if len(shape) != 2 or data.ndim != 2 or data.shape[0] != shape[0]:
            return self.read().narrow(dim, start, length)
        if dim == 0:
            w = self._decode(data[start : start + length], (length, shape[1]))
            if self.row_heads:
                head_dim = shape[0] // self.row_heads
                if start % head_dim or length % head_dim:
                    return self.read().narrow(0, start, length)
                w = unpermute_rows(w, length // head_dim)
            return w
        block, _type_size = GGML_QUANT_SIZES[GGMLQuantizationType[self.t.type_name]]
        if self.row_heads or start % block or length % block:
            return self.read().narrow(dim, start, length)
        per = data.shape[1] // (shape[1] // block)  # bytes (or elements) per block as the reader maps it
        return self._decode(data[:, start // block * per : (start + length) // block * per], (shape[0], length))


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to HF's half-split order."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
