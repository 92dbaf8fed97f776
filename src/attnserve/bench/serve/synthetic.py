"""A word-level tokenizer for random-weight benchmark models: token i is the word `w{i}`.

A random-weight model directory (e.g. the Llama-3-8B shape made on a GPU machine with
no network) still needs a tokenizer that both attnserve and peer servers can load.
With one word per token and whitespace between words, any id sequence decodes to text
that encodes back to the same ids, so every server sees exactly the prompt length asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (the llama presets' bos 1 / eos 2 when the vocab is small)


def word_tokenizer(vocab_size: int):
    """tokenizers.Tokenizer with `vocab_size` entries: the specials, then w3 ... w{vocab_size-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size {vocab_size}: must exceed {len(SPECIALS)} (the special tokens)")
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write_tokenizer_dir(path: Path, vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2) -> None:
    """tokenizer.json + tokenizer_config.json loadable by attnserve and by transformers' AutoTokenizer.

    Special tokens are named by id: when the model's bos/eos ids lie past the specials (the real
    Llama-3 ids 128000/128001), those words serve as BOS/EOS."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = word_tokenizer(vocab_size)
    tok.save(str(path / "tokenizer.json"))

    def name(i: int) -> str:
        return tok.id_to_token(i)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos_token_id),
        "eos_token": name(eos_token_id),
        "unk_token": "<unk>",
        "pad_token": name(eos_token_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
