"""The backend contract's module stands alone: the layer depends on it, never the other way round."""

import ast
from pathlib import Path

from attnserve.attention import base
from attnserve.attention.base import AttentionLayerParams
from attnserve.reference.synthetic import make_batch


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_base_does_not_import_the_layer():
    """Not even for type checking: base and layer importing each other was a circle."""
    imported = _imported_modules(Path(base.__file__))
    assert not any(m.startswith("attnserve.attention.layer") for m in imported), imported
    assert not any(m.startswith(("attnserve.models", "attnserve.engine")) for m in imported)


def test_the_layer_is_what_backends_read():
    layer = make_batch([3], [2]).layer
    assert isinstance(layer, AttentionLayerParams)
    for name in AttentionLayerParams.__annotations__:
        assert hasattr(layer, name), name
