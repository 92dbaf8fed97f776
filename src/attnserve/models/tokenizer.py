"""Tokenizer and chat template, from an HF model directory or from GGUF metadata.

Text <-> ids goes through the `tokenizers` library; chat templates are the
model's own Jinja templates rendered in a sandbox with the helpers HF templates
expect (raise_exception, tojson, strftime_now), so prompts are byte-identical to
what the model was trained on.

`encode`, `decode` and `chat_prompt` take any tokenizer with `encode`/`decode`
(ours, or an HF one handed to the engine), so the engine and the server share
one way from text to ids and back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF tokenizer.ggml.pre -> the split regex its merges were learned with (None: GPT-2's, inside ByteLevel)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GPT2_SPLIT_PRES = (None, "default", "gpt2", "smollm", "gpt-2")
_UNKNOWN = 2  # GGUF token types: unknown, control (special), user-defined (added, not special)
_CONTROL = 3
_USER_DEFINED = 4


class Tokenizer:
    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: list[int], add_bos_token: bool,
                 chat_template: str | None, special_tokens: dict[str, str | None] | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, with the model's BOS once: text that already begins with BOS (a rendered chat
        template usually does) does not get a second one, which would shift the model off its training."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        wants_bos = add_special_tokens and self.add_bos_token and bos is not None
        if wants_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
            bos_text = self.special_tokens.get("bos_token")
            if bos_text and text.startswith(bos_text):
                ids = ids[1:]
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template and tokenise it exactly as written (the template places BOS itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, self.special_tokens, **extra)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Path, config: dict) -> Tokenizer | None:
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja); None when the directory has none."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            return None
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ValueError(f"{tok_file}: not a readable tokenizer.json ({exc})") from exc
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = backend.token_to_id(special["bos_token"]) if special.get("bos_token") else config.get("bos_token_id")
        eos = config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if special.get("eos_token") and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids = list(dict.fromkeys(eos_ids + [backend.token_to_id(special["eos_token"])]))
        # tokenizer.json's post-processor already adds BOS where the model wants it
        return cls(backend, bos_id, eos_ids, add_bos_token=False, chat_template=template, special_tokens=special)

    @classmethod
    def from_gguf(cls, fields: dict, source: str) -> Tokenizer:
        if fields["model"] == "gpt2":
            backend = _byte_level_backend(fields, source)
        elif fields["model"] == "llama":
            backend = _sentencepiece_backend(fields)
        else:
            raise ValueError(f"{source}: unsupported GGUF tokenizer model {fields['model']!r}; "
                             "supported: gpt2 (byte-level BPE), llama (sentencepiece BPE)")
        tokens = fields["tokens"]
        types = fields["token_type"]
        special_types = (_CONTROL,) if fields["model"] == "gpt2" else (_CONTROL, _UNKNOWN)
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t in special_types])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _USER_DEFINED])
        bos, eos = fields.get("bos_token_id"), fields.get("eos_token_id")
        special = {"bos_token": tokens[bos] if bos is not None else None,
                   "eos_token": tokens[eos] if eos is not None else None}
        return cls(backend, bos, [eos] if eos is not None else [], fields["add_bos_token"],
                   fields.get("chat_template"), special)


def _byte_level_backend(fields: dict, source: str):
    """GPT-2 style byte-level BPE with the split regex the vocabulary's `pre` names."""
    vocab = {t: i for i, t in enumerate(fields["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = fields.get("pre")
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _GPT2_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        known = sorted(set(_PRE_SPLITS) | {p for p in _GPT2_SPLIT_PRES if p})
        raise ValueError(f"{source}: unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(known)}")
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(fields: dict):
    """Sentencepiece BPE (Llama 2, Mistral v0.1, TinyLlama): '▁' for spaces, <0xXX> byte fallback.

    Files usually carry scores instead of merges; merges are then rebuilt from the scores: every
    split of a token into two vocabulary pieces is a merge, ranked by the merged token's score.
    With tokenizer.ggml.add_space_prefix (llama.cpp's default for these vocabularies) each run of
    text, at the start and after every special token, gets one '▁' in front even when it already
    starts with a space (" hi" is "▁▁hi"), as sentencepiece's dummy prefix and llama.cpp do; the
    decoder drops that one leading space again.
    """
    tokens = fields["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if fields["merges"]:
        merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, fields["scores"])))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    # the normalizer runs on each piece of text between special tokens, so each piece gets the prefix
    prefix = [normalizers.Prepend("\u2581")] if fields["add_space_prefix"] else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(content=" ", left=1)] if prefix else [])])
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: best-scoring merged token first; ties keep vocab order."""
    merges = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # stable: equal keys stay in the order above
    return [(left, right) for left, right, _ in merges]


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         special_tokens: dict | None = None, **extra) -> str:
    """Render an HF chat template the way HF does (sandboxed Jinja, trim_blocks, lstrip_blocks)."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(extra)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def encode(tokenizer, text: str) -> list[int]:
    """Text -> ids with any tokenizer (ours returns a list, an HF `tokenizers.Tokenizer` an Encoding)."""
    out = tokenizer.encode(text)
    return list(getattr(out, "ids", out))


def decode(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def chat_prompt(tokenizer, template: str | None, prompt: str | list[dict], system: str | None = None) -> str:
    """One user message (or a message list) rendered with the model's chat template.

    `template` is the model's own (from its files); a tokenizer with `apply_chat_template` renders it
    itself. A template shipped inside a model file is untrusted code: it is rendered sandboxed."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; drop --chat")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    render = getattr(tokenizer, "apply_chat_template", None)
    if callable(render):
        return render(messages)
    return render_chat_template(template, messages, add_generation_prompt=True,
                                special_tokens={"bos_token": "", "eos_token": ""})
