"""The Gluon prefill's module switches (prefill_gluon.STAGES, PINGPONG, ...) set from text, so a sweep or a
profile can race a schedule that is built but off without editing the module."""

from __future__ import annotations

import contextlib


def parse_gluon_settings(assignments: str) -> dict:
    """"NAME=VALUE[,NAME=VALUE]" -> {NAME: value}: each value an int (a bool switch takes 0 or 1) of an upper-case
    name the Gluon prefill's module has; "" sets none."""
    from attnserve.attention.kernels.mha import prefill_gluon

    new = {}
    for item in assignments.split(",") if assignments else []:
        name, _, value = item.partition("=")
        if not name.isupper() or not hasattr(prefill_gluon, name):
            raise SystemExit(f"prefill_gluon has no switch {name!r}")
        new[name] = type(getattr(prefill_gluon, name))(int(value))
    return new


@contextlib.contextmanager
def gluon_settings(assignments: str):
    """The Gluon prefill's module switches set while the block runs (parse_gluon_settings)."""
    from attnserve.attention.kernels.mha import prefill_gluon

    new = parse_gluon_settings(assignments)
    saved = {name: getattr(prefill_gluon, name) for name in new}
    for name, value in new.items():
        setattr(prefill_gluon, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(prefill_gluon, name, value)
