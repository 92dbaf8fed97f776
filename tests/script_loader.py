"""Load a script of the repository's tools/ or benchmarks/ (not a package) as a module, for tests of its functions."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
    """The script at ROOT / relative_path, executed once as a module of its file's name."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
