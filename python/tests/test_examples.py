"""The examples are valid Python that uses only names the package exports (they run on a GPU in test_gpu.py)."""

import ast

import pytest

import mkernel
import mkernel.nn
from docs_example import TP_MLP, doc_example


def _mkernel_attributes(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mkernel"
    }


def test_doc_example_uses_exported_names():
    source = doc_example()
    if source is None:
        pytest.skip("docs/python.md is not in this checkout")
    names = _mkernel_attributes(ast.parse(source))
    assert names and all(hasattr(mkernel, n) for n in names), names


def test_tp_mlp_example_uses_exported_names():
    if not TP_MLP.is_file():
        pytest.skip("examples/ is not in this checkout")
    tree = ast.parse(TP_MLP.read_text())
    names = _mkernel_attributes(tree)
    assert names and all(hasattr(mkernel, n) for n in names), names
    imported = {
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "mkernel.nn"
        for a in node.names
    }
    assert imported == {"ColumnParallelLinear", "RowParallelLinear"}
    assert all(hasattr(mkernel.nn, n) for n in imported)
