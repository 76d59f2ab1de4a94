"""The package's shape: one concept per module, no product code reaching into bench/ (checked on the sources)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "cluster", "decode", "engine", "kernels", "kvstore", "prefill", "replay", "router")
TOP_MODULES = ("cli.py", "messages.py", "native_build.py", "registry.py", "settings.py")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def product_modules() -> list[Path]:
    modules = [ROOT / name for name in TOP_MODULES]
    for package in PACKAGES:
        modules.extend(path for path in sorted((ROOT / package).rglob("*.py")) if "_pb2" not in path.name)
    return modules


@pytest.mark.parametrize("path", product_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_modules_and_classes_stay_small(path: Path) -> None:
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES, f"{path.name}: split it by concept"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            assert node.end_lineno - node.lineno + 1 <= MAX_CLASS_LINES, f"class {node.name} in {path.name}"


@pytest.mark.parametrize("path", product_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_product_code_never_loads_benchmarks(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            raise AssertionError(f"{path.name} loads a module from a file path")
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in ("bench", "_common"), f"{path.name} imports {name}"
            assert not name.startswith("rayturn.bench"), f"{path.name} imports {name}"
