"""The engine's command-line flags, built from `EngineConfig`'s fields (one declaration of every knob).

    add_engine_arguments(parser)             every EngineConfig knob as a flag (serve, generate)
    add_engine_arguments(parser, only=...)   some of them, a default or help replaced (tune)
    engine_config(args) -> EngineConfig      the parsed flags as the config, checked once
    run_other_node(args)                     --node-rank > 0: this machine's ranks only

Each flag's destination is its field's name, so `engine_config` needs no mapping of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from attnserve.choice.registry import REGISTRY
from attnserve.engine.config import EngineConfig
from attnserve.engine.tensor_parallel import run_node


def engine_knobs() -> list[dataclasses.Field]:
    """The EngineConfig fields that are command-line knobs, in the order the help lists them."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("flags")]


def _value_type(f: dataclasses.Field) -> type:
    """int / float / str / bool from the field's annotation (`int | None` -> int)."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return kinds[0]


def add_engine_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                         overrides: dict[str, dict] | None = None) -> None:
    """Add the knobs (all, or the fields named in `only`) as flags; `overrides[field]` replaces a
    flag's argparse settings, e.g. its default or help."""
    backends = ", ".join(sorted(name for name, spec in REGISTRY.items() if spec.implemented))
    for f in engine_knobs():
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        kwargs = {"dest": f.name, "default": f.default, "help": meta["help"].replace("{backends}", backends)}
        kind = _value_type(f)
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = meta["flags"][0].lstrip("-").replace("-", "_").upper()  # as argparse names it
            if kind is not str:
                kwargs["type"] = kind
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        if "choices" in meta:
            kwargs["choices"] = list(meta["choices"])
            kwargs.pop("metavar")  # argparse lists the choices instead
        kwargs.update((overrides or {}).get(f.name, {}))
        p.add_argument(*meta["flags"], **kwargs)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags (its checks run here, before any weights load)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in engine_knobs()})


def run_other_node(args: argparse.Namespace) -> int:
    """`--node-rank` > 0: host this machine's tensor-parallel ranks until node 0 ends the world."""
    return run_node(engine_config(args))
