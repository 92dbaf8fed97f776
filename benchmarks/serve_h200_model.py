"""Make a Llama-3-8B-shaped HF model directory with random bf16 weights, for the serving run.

The GPU machine has no network, so the model both servers load (attnserve and the peer,
`transformers serve`) is made there: config.json of the llama-3-8b preset, a word-level
tokenizer of the same vocabulary size (token i is the word `w{i}`, so prompts of random
words have exactly the length asked for in either server), and Normal(0, 0.02) weights
under the Hugging Face Llama names, written as safetensors shards.

    PYTHONPATH=src python3 benchmarks/serve_h200_model.py /tmp/llama3-8b-random [--tiny] [--no-weights]

`--no-weights` writes the config and tokenizer only: enough for servers started with
`--random-weights` (they draw the weights on the device), in seconds instead of a 16 GB write.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def llama_tensors(cfg: dict):
    """(name, shape) of every weight of a LlamaForCausalLM with this config, in file order."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (q, h)
        yield f"{p}.self_attn.k_proj.weight", (kv, h)
        yield f"{p}.self_attn.v_proj.weight", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", (h, q)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (inter, h)
        yield f"{p}.mlp.up_proj.weight", (inter, h)
        yield f"{p}.mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def write_weights(path: Path, cfg: dict, device: str, shard_bytes: int = 4 << 30) -> int:
    """Random weights in shards of about shard_bytes, plus model.safetensors.index.json.
    Returns the total bytes."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for name, shape in llama_tensors(cfg):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)  # [h] norm weights
        else:
            t = (
                torch.empty(shape, dtype=torch.bfloat16, device=device)
                .normal_(0.0, 0.02, generator=gen)
                .cpu()
            )
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument(
        "--tiny", action="store_true", help="2 layers, hidden 256, vocab 1000 (checks the script on a CPU)"
    )
    ap.add_argument(
        "--no-weights", action="store_true", help="config and tokenizer only (for --random-weights servers)"
    )
    args = ap.parse_args()

    from attnserve.bench.serve.synthetic import write_tokenizer_dir
    from attnserve.presets import PRESETS

    start = time.perf_counter()
    cfg = {k: v for k, v in PRESETS[args.preset].items() if not k.startswith("_")}
    if args.tiny:
        cfg.update(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=1000,
            bos_token_id=1,
            eos_token_id=2,
        )
    cfg["torch_dtype"] = "bfloat16"
    args.path.mkdir(parents=True, exist_ok=True)
    (args.path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (args.path / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    write_tokenizer_dir(args.path, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = 0 if args.no_weights else write_weights(args.path, cfg, device)
    print(
        json.dumps(
            {
                "model_dir": str(args.path),
                "weight_bytes": total,
                "preset": args.preset,
                "tiny": args.tiny,
                "seconds": round(time.perf_counter() - start, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
