"""`attnserve bench <what>`: measurements on this machine. Each sub-command is a module of attnserve.bench."""

from __future__ import annotations

from attnserve.bench import baseline, kernels
from attnserve.bench.serve import sweep

# sub-command -> (module with add_arguments(parser) and run(args), one-line help)
BENCHES = {
    "kernels": (kernels, "race the attention backends on fixed decode/prefill workloads"),
    "serve": (sweep, "load sweep against OpenAI-compatible servers: TTFT/TPOT/ITL per backend"),
    "compare": (baseline, "compare two stored runs (bench kernels or tune JSON); exit 3 if the first is slower"),
}


def add_parser(sub):
    p = sub.add_parser("bench", help="measure attention kernels and serving under load on this machine")
    inner = p.add_subparsers(dest="bench", required=True)
    for name, (module, summary) in BENCHES.items():
        q = inner.add_parser(name, help=summary, description=summary)
        module.add_arguments(q)
        q.set_defaults(_bench_module=module)
    return p


def run(args) -> int:
    return int(args._bench_module.run(args) or 0)
