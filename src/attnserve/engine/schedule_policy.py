"""How many prompt tokens a step may take, and in which order waiting prompts are admitted.

Step token budget (Sarathi-Serve's stall-free batching). A step that decodes runs as long as its
whole batch: a 64-request decode with an 8,192-token prompt chunk beside it takes as long as
the chunk, and every stream stalls for it. The budget bounds the prompt tokens a step that
decodes may add; a step with nothing decoding has no stream to stall and always takes the full
`chunked_prefill_size` (it fills the device better and shortens the time to first token when a
burst arrives on an idle server). Without chunked prefill no budget applies (a prompt runs
whole or waits, as it always does then).

`--max-num-batched-tokens` (vLLM's name) picks the budget; `resolve_step_budget` is the one place
that turns the flag and the device into a `StepBudget`, with the reason the start-up log prints:

- a number N > 0, `fixed`: a step that decodes holds at most N tokens, its decodes included (one
  each, as SGLang's mixed chunk counts them), so prompts get N - D beside D decodes;
- `<= 0`, `off`: a whole chunk joins the decodes;
- `auto[:S]`, the decode-scaled policy: beside D running decodes a step adds
  min(chunk, max(AUTO_MIN_PREFILL, S / D)) prompt tokens (S: `AUTO_STREAM_TOKENS` unless given);
- unset: the device's default, a fixed max(floor, 2 x max running requests): on a GPU a floor of
  1024 where prompt-carrying steps replay piecewise CUDA graphs (`benchmarks/results/
  serve-budget-h100-piecewise.json`), else 2048, from the H200 sweep in
  `benchmarks/results/serve-budget-h200.json` (of the budgets within 0.95x of the best offline
  throughput, the one with the lowest ITL p99); on a CPU 512, from
  `benchmarks/results/serve-budget-cpu.json` (there every prompt token beside the decodes is a stall).

The cost model behind `auto`. A step of D decodes and P prompt tokens takes about
T = t0 + t_dec(D) + t_mix + t_tok * P: t0 reads the weights (Llama-3-8B on an H200: ~3.8 ms),
t_dec(D) reads the decodes' K/V, t_mix is what a mixed step costs beyond a decode step besides
its tokens (it runs eagerly, outside the decode CUDA graphs, and plans an extend step), and
t_tok is the compute of one prompt token (~25 us there). Each of the D streams waits
t_mix + t_tok * P longer than a decode step, so the step costs the streams D * (t_mix + t_tok * P)
in all. `auto` bounds D * P by S: with many streams each step adds few prompt tokens, with few
streams big chunks (they stall few streams). The floor, AUTO_MIN_PREFILL = 256 tokens, is where a
step's matmuls turn from reading the weights to computing; the cap is the chunk. On the H200 sweep
fixed budgets beat it on both counts: t_mix (about 23 ms) dominates a mixed step from 256 to 2,048
prompt tokens, and a whole chunk beside a few streams stalls them for up to the chunk's time.

Policy (`--schedule-policy`, SGLang's names):
- fcfs: arrival order (a preempted request goes back to the front). No prompt waits behind
  later arrivals, so the time to first token stays bounded under any mix of prompts.
- lpm: longest prefix match first, by the tokens the radix cache already holds; prompts that
  share a cached system prompt run together while it is cached. A prompt with no match can wait
  behind a stream of matching ones. Like SGLang, above `LPM_MAX_WAITING` waiting requests the
  prefix lookups cost more than they save, and the order falls back to arrival; with the radix
  cache off there is nothing to match, so lpm is fcfs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "lpm")
LPM_MAX_WAITING = 128

AUTO = "auto"
AUTO_STREAM_TOKENS = 65536  # S: decodes x prompt tokens one step may hold under `auto`
AUTO_MIN_PREFILL = 256  # the fewest prompt tokens `auto` gives a step, however many decodes run
CPU_BUDGET_MIN = 512  # the CPU default: max(CPU_BUDGET_MIN, 2 x max running requests)
CPU_BUDGET_SOURCE = "benchmarks/results/serve-budget-cpu.json"
GPU_BUDGET_MIN = 2048  # the GPU default: max(GPU_BUDGET_MIN, 2 x max running requests)
GPU_BUDGET_SOURCE = "benchmarks/results/serve-budget-h200.json"
GPU_PIECEWISE_BUDGET_MIN = 1024  # the GPU default where prompt-carrying steps replay piecewise CUDA graphs
GPU_PIECEWISE_BUDGET_SOURCE = "benchmarks/results/serve-budget-h100-piecewise.json"


@dataclass(frozen=True)
class StepBudget:
    """How many prompt tokens a step that decodes may add (see the module docstring).

    kind: "fixed" (at most `tokens` in the step, decodes included), "auto" (beside D decodes,
    min(chunk, max(min_prefill, stream_tokens // D)) prompt tokens) or "off" (a whole chunk)."""

    kind: str
    tokens: int | None = None
    stream_tokens: int = AUTO_STREAM_TOKENS
    min_prefill: int = AUTO_MIN_PREFILL
    reason: str = ""

    def __post_init__(self):
        if self.kind not in ("fixed", "auto", "off"):
            raise ValueError(f"step budget kind must be fixed, auto or off, got {self.kind!r}")
        if self.kind == "fixed" and (self.tokens is None or self.tokens < 1):
            raise ValueError(f"a fixed step budget needs tokens >= 1, got {self.tokens}")
        if self.stream_tokens < 1 or self.min_prefill < 1:
            raise ValueError(f"auto step budget: stream_tokens {self.stream_tokens} and min_prefill "
                             f"{self.min_prefill} must be >= 1")

    @property
    def label(self) -> str:
        """The flag's value that gives this budget: N, off, auto or auto:S."""
        if self.kind == "fixed":
            return str(self.tokens)
        if self.kind == "auto":
            return AUTO if self.stream_tokens == AUTO_STREAM_TOKENS else f"{AUTO}:{self.stream_tokens}"
        return "off"

    def prefill_tokens(self, decodes: int, full: int) -> int:
        """Prompt tokens a step with `decodes` decodes may add; `full` is the chunk (the cap)."""
        if decodes <= 0 or self.kind == "off":
            return full
        if self.kind == "fixed":
            return max(0, min(full, self.tokens - decodes))
        return min(full, max(self.min_prefill, self.stream_tokens // decodes))

    def describe(self, chunk: int | None) -> str:
        """One line for the start-up log: the rule, what it gives at a few batch sizes, and why."""
        if chunk is None:
            return f"{self.label} (no effect: chunked prefill is off, a prompt runs whole); {self.reason}"
        if self.kind == "off":
            return f"off: a whole {chunk}-token chunk joins the running decodes; {self.reason}"
        if self.kind == "fixed":
            return (f"{self.tokens} tokens in a step that decodes, its decodes included (a step with "
                    f"nothing decoding takes a whole {chunk}-token chunk); {self.reason}")
        examples = ", ".join(f"{d}: {self.prefill_tokens(d, chunk)}" for d in (1, 8, 32, 64, 128, 256))
        return (f"auto: beside D running decodes a step adds min({chunk}, max({self.min_prefill}, "
                f"{self.stream_tokens} / D)) prompt tokens (D {examples}); {self.reason}")


OFF = StepBudget("off", reason="off")


def parse_step_budget(value) -> int | str | None:
    """The flag's value as the config keeps it: None (unset), an int (<= 0: off), "auto" or "auto:S".

    Accepts what argparse hands over (a string) and what Python callers pass (an int or None)."""
    if isinstance(value, bool):
        raise ValueError(f"max_num_batched_tokens must be a number, auto or auto:S, got {value!r}")
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    if text.startswith(AUTO + ":"):
        try:
            s = int(text[len(AUTO) + 1:])
        except ValueError:
            s = 0
        if s < 1:
            raise ValueError(f"max_num_batched_tokens {value!r}: auto:S needs S >= 1 (decodes x prompt tokens a "
                             "step may hold)")
        return f"{AUTO}:{s}"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"max_num_batched_tokens must be a number, auto or auto:S, got {value!r}") from None


def checked_step_budget(value, max_running_requests: int) -> int | str | None:
    """`parse_step_budget`, and a fixed budget refused when a full decode batch would fill it (no room for a
    prompt token): what the config and `Engine.set_step_budget` accept."""
    value = parse_step_budget(value)
    if isinstance(value, int) and 0 < value <= max_running_requests:
        raise ValueError(
            f"max_num_batched_tokens {value} must exceed max_running_requests {max_running_requests} (a full "
            "decode batch would leave no room for a prompt token), or be <= 0 to turn the step budget off")
    return value


def resolve_step_budget(value, max_running_requests: int, device_type: str, piecewise: bool = False) -> StepBudget:
    """The step budget the flag's value gives on this device (`device_type`: "cpu", "cuda", ...); `piecewise`:
    the engine replays piecewise CUDA graphs for prompt-carrying steps, which makes a mixed step's fixed cost small."""
    value = parse_step_budget(value)
    if value is None:
        if device_type == "cpu":
            floor, why = CPU_BUDGET_MIN, (f"on a CPU every prompt token beside the decodes is a stall the streams see "
                                          f"({CPU_BUDGET_SOURCE})")
        elif piecewise:
            floor, why = GPU_PIECEWISE_BUDGET_MIN, (
                "with piecewise CUDA graphs a mixed step costs little beyond its tokens (on an H100 a 512-token one "
                "took 22 ms in pieces against 27 ms eager), so 1024 keeps 0.96x the best throughput at an ITL p99 "
                f"of 3x the p50 ({GPU_PIECEWISE_BUDGET_SOURCE})")
        else:
            floor, why = GPU_BUDGET_MIN, (
                "on the H200 the lowest stall of the budgets within 0.95x of the best throughput: an eager mixed "
                "step's fixed cost (a 512-token one took 33 ms against a 7.4 ms decode step) makes smaller budgets "
                f"pay it too often ({GPU_BUDGET_SOURCE})")
        device = "CPU" if device_type == "cpu" else "GPU"
        return StepBudget("fixed", max(floor, 2 * max_running_requests), reason=(
            f"the {device} default (max({floor}, 2 x --max-running-requests)): {why}"))
    if isinstance(value, str):
        s = int(value.split(":")[1]) if ":" in value else AUTO_STREAM_TOKENS
        return StepBudget("auto", stream_tokens=s, reason=f"--max-num-batched-tokens {value}")
    if value <= 0:
        return StepBudget("off", reason=f"--max-num-batched-tokens {value}")
    return StepBudget("fixed", value, reason=f"--max-num-batched-tokens {value}")


def prefill_token_budget(
    chunked_prefill_size: int | None,
    max_prefill_tokens: int,
    budget: StepBudget,
    step_tokens: int,
) -> int:
    """Prompt tokens the step may add on top of the `step_tokens` its decodes already hold.

    0 when a fixed budget is filled by the decodes: the prompts wait for a step with room (the config check
    keeps room for at least one prompt token beside a full decode batch)."""
    full = chunked_prefill_size or max_prefill_tokens
    if step_tokens == 0 or chunked_prefill_size is None:
        return full
    return budget.prefill_tokens(step_tokens, full)


def order_waiting(waiting: deque, policy: str, cached_tokens) -> None:
    """Reorder `waiting` in place for admission; `cached_tokens(req)` is its radix-cache hit in tokens
    (None when there is no cache)."""
    if policy == "fcfs" or cached_tokens is None or len(waiting) < 2:
        return
    if len(waiting) > LPM_MAX_WAITING:
        ranked = sorted(waiting, key=lambda r: r.arrival_time)
    else:  # sorted() is stable: equal keys keep the queue's order
        ranked = sorted(waiting, key=lambda r: (-cached_tokens(r), r.arrival_time))
    waiting.clear()
    waiting.extend(ranked)
