"""The package versions a measurement depends on: what a stored timing is only valid for.

A tune result or kernel race taken with one torch / triton / FlashInfer / attnserve is
not evidence about another (one FlashInfer upgrade has made Hopper decode several times
slower: SGLang issue 17411), so results record these and selection compares them before trusting one.
Read from package metadata: nothing heavy is imported.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
from pathlib import Path

from attnserve import __version__

# the distributions whose version changes attention speed (CUDA comes with torch)
TIMED_PACKAGES = ("torch", "triton", "flashinfer-python", "flash-attn-4", "attnserve")


def package_versions() -> dict[str, str]:
    """{distribution: version} for each of TIMED_PACKAGES installed here, plus torch's CUDA ("cuda")."""
    out: dict[str, str] = {}
    for pkg in TIMED_PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    out["attnserve"] = __version__  # the code running now, also when it runs from a checkout, not installed
    try:
        import torch

        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        out["torch"] = torch.__version__  # the build tag (+cu130 / +cpu) is part of what was timed
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return out


def source_commit() -> str | None:
    """The short git commit of the checkout this package runs from; None when it is not in one."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def version_changes(then: dict, now: dict) -> list[str]:
    """What differs between two version maps, in words ('torch 2.11.0 -> 2.13.0', 'triton absent -> 3.6.0')."""
    changes = []
    for pkg in sorted(set(then) | set(now)):
        old, new = then.get(pkg), now.get(pkg)
        if old != new:
            changes.append(f"{pkg} {old or 'absent'} -> {new or 'absent'}")
    return changes


__all__ = ["TIMED_PACKAGES", "package_versions", "source_commit", "version_changes"]
