"""End to end on the embedded SmolLM2-135M (real weights, real tokenizer) and the `generate` CLI."""

import json

import pytest

from attnserve.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def llm():
    from attnserve.engine.llm import LLM

    # fp32: batching must not change a request's tokens, which holds where the kernels do not depend on the
    # batch; bf16 / int4 pick their matmul by rows (test_cpu_precision bounds them against fp32)
    return LLM(device="cpu", dtype="fp32", max_total_tokens=2048, chunked_prefill_size=4)


@pytest.mark.needs_embedded_model
def test_batched_matches_one_at_a_time(llm):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    llm.engine.flush_cache()
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert together == alone
    again = llm.generate(PROMPTS, params)  # now served from the prefix cache
    assert [o.token_ids for o in again] == alone
    assert all(o.cached_tokens > 0 for o in again)
    assert llm.engine.pages_leaked() == 0


@pytest.mark.needs_embedded_model
def test_text_is_the_decoded_tokens_and_eos_stops(llm):
    out = llm.generate(llm.apply_chat_template("Say hi."), SamplingParams(max_new_tokens=64))[0]
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in llm.engine.eos_token_ids


@pytest.mark.needs_embedded_model
def test_generate_cli_json_with_prompts_file(tmp_path, capsys):
    from attnserve.cli import main

    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS[:3] + [PROMPTS[0]]) + "\n")
    rc = main(["generate", "--prompts-file", str(f), "--json", "--max-new-tokens", "8", "--quiet",
               "--max-total-tokens", "1024"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines[:-1]] == PROMPTS[:3] + [PROMPTS[0]]
    for x in lines[:-1]:
        assert {"prompt", "text", "token_ids", "finish_reason", "ttft_s", "tpot_s"} <= set(x)
        assert len(x["token_ids"]) <= 8
    assert lines[0]["token_ids"] == lines[3]["token_ids"]
    totals = lines[-1]["totals"]
    assert totals["pages_leaked"] == 0 and totals["requests"] == 4
    assert totals["throughput_tok_per_s"] > 0


def test_generate_cli_errors(capsys):
    from attnserve.cli import main

    assert main(["generate"]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", "x", "--temperature", "-1", "--quiet"]) == 2
    assert "temperature" in capsys.readouterr().err
