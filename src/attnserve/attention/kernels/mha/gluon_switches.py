"""A Gluon kernel module's switches (prefill_gluon.STAGES, PINGPONG, ...; the MLA launch's SEESAW_WHOLE_TILES) set
from text, so a sweep or a profile can race a schedule that is built but off without editing the module."""

from __future__ import annotations

import contextlib
import importlib

PREFILL = "attnserve.attention.kernels.mha.prefill_gluon"
MLA_DECODE = "attnserve.attention.kernels.mla.gluon.launch"


def parse_gluon_settings(assignments: str, module: str = PREFILL) -> dict:
    """"NAME=VALUE[,NAME=VALUE]" -> {NAME: value}: each value an int (a bool switch takes 0 or 1) of an upper-case
    name the module (the Gluon prefill's by default) has; "" sets none."""
    target = importlib.import_module(module)
    new = {}
    for item in assignments.split(",") if assignments else []:
        name, _, value = item.partition("=")
        if not name.isupper() or not hasattr(target, name):
            raise SystemExit(f"{module.rsplit('.', 1)[-1]} has no switch {name!r}")
        new[name] = type(getattr(target, name))(int(value))
    return new


@contextlib.contextmanager
def gluon_settings(assignments: str, module: str = PREFILL):
    """The module's switches set while the block runs (parse_gluon_settings)."""
    target = importlib.import_module(module)
    new = parse_gluon_settings(assignments, module)
    saved = {name: getattr(target, name) for name in new}
    for name, value in new.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)
