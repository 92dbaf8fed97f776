"""The fused MoE kernel's tiles per GPU architecture, token count and expert shape: data, not code.

A batch of one token reads six experts' weights and wants many narrow programs; thousands of tokens want
wide row blocks that reuse each weight tile. The tiles are rules, first match wins, kept in
`fused_moe_tiles.json` (package data) and rewritten from a GPU sweep (`tools/sweep_fused_moe.py --apply`).
Both kernels share the row block (block_m): it is the alignment's padding. Plain Python: read on machines
without triton or a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from attnserve.rule_tables import package_file, read_table, write_arch_rules

TABLE_FILE = "fused_moe_tiles.json"
TABLE_PACKAGE = "attnserve.ops"
SHAPE_KEYS = ("experts", "hidden", "intermediate", "top_k")


@dataclass(frozen=True)
class GemmTile:
    """One kernel's output columns and reduction step per program, and its launch settings."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmTile.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"GemmTile needs num_warps a power of two up to 16 and num_stages >= 1, got "
                             f"{self.num_warps} and {self.num_stages}")


@dataclass(frozen=True)
class MoETiles:
    """block_m: pair rows per program (and the alignment's padding); gate_up: the gate+up kernel's tile over
    the expert channels; down: the down kernel's tile over the hidden size."""

    block_m: int = 16
    gate_up: GemmTile = GemmTile()
    down: GemmTile = GemmTile()

    def __post_init__(self):
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"MoETiles.block_m must be a power of two >= 16, got {self.block_m}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MoETiles:
        return cls(int(d["block_m"]), GemmTile(**d["gate_up"]), GemmTile(**d["down"]))


@dataclass(frozen=True)
class TileRule:
    """Holds for batches of at most max_tokens tokens (None: any) of the shape given (a key left out: any)."""

    tiles: MoETiles
    max_tokens: int | None = None
    shape: tuple[tuple[str, int], ...] = ()

    def holds(self, tokens: int, shape: dict[str, int]) -> bool:
        return (self.max_tokens is None or tokens <= self.max_tokens) and all(shape.get(k) == v for k, v in self.shape)


def parse_rules(table: dict) -> dict[str, tuple[TileRule, ...]]:
    """arch -> rules; every arch's list must end in a rule that holds for every batch and shape."""
    out = {}
    for arch, rows in table["rules"].items():
        rules = []
        for r in rows:
            shape = tuple(sorted((k, int(v)) for k, v in r.get("shape", {}).items()))
            if any(k not in SHAPE_KEYS for k, _ in shape):
                raise ValueError(f"{TABLE_FILE}: shape keys are {', '.join(SHAPE_KEYS)}, got {dict(shape)}")
            rules.append(TileRule(MoETiles.from_json(r["tiles"]), r.get("max_tokens"), shape))
        if not rules or rules[-1].max_tokens is not None or rules[-1].shape:
            raise ValueError(f"{TABLE_FILE}: the rules of {arch!r} must end in one without max_tokens or shape "
                             "(a default for every batch)")
        out[arch] = tuple(rules)
    if "default" not in out:
        raise ValueError(f"{TABLE_FILE}: no 'default' architecture")
    return out


@functools.cache
def shipped_rules() -> dict[str, tuple[TileRule, ...]]:
    return parse_rules(read_table(TABLE_PACKAGE, TABLE_FILE))


def tiles_for(arch: str, tokens: int, shape: dict[str, int],
              rules: dict[str, tuple[TileRule, ...]] | None = None) -> MoETiles:
    """The first rule of `arch` (else 'default') that holds for this many tokens and this expert shape."""
    rules = rules or shipped_rules()
    for rule in rules.get(arch, rules["default"]):
        if rule.holds(tokens, shape):
            return rule.tiles
    raise AssertionError("every arch's rules end in one that always holds")  # pragma: no cover


# the interpreter's tiles: the smallest tl.dot takes, so the CPU tests run few, small programs
INTERPRETER_TILES = MoETiles(16, GemmTile(16, 16, 4, 1), GemmTile(16, 16, 4, 1))


def rules_from_sweep(best: list[dict], shape: dict[str, int]) -> list[dict]:
    """Table rules (JSON rows) from a sweep's best tiles per token count `[{"tokens", "tiles", "measured_us"}]`
    at one expert shape: neighbouring token counts with the same tiles share a rule. The rules come twice: for
    the shape swept, then for any shape (the measured tiles are a better guess for other experts than none),
    the largest count's rule open-ended to close the list."""
    out: list[dict] = []
    for row in sorted(best, key=lambda r: r["tokens"]):
        if out and out[-1]["tiles"] == row["tiles"]:
            out[-1]["max_tokens"] = row["tokens"]
            out[-1]["measured_us"].update(row.get("measured_us", {}))
        else:
            out.append({"max_tokens": row["tokens"], "shape": dict(shape), "tiles": row["tiles"],
                        "measured_us": dict(row.get("measured_us", {}))})
    if not out:
        return []
    any_shape = [{"max_tokens": r["max_tokens"], "tiles": r["tiles"]} for r in out]
    del any_shape[-1]["max_tokens"]
    return out + any_shape


def write_rules(arch: str, rules: list[dict], source: str, path: Path | None = None) -> Path:
    """Replace one architecture's rules in the table file (the package's by default); checked before writing."""
    path = write_arch_rules(path or package_file(TABLE_PACKAGE, TABLE_FILE), arch, rules, source, parse_rules)
    shipped_rules.cache_clear()
    return path
