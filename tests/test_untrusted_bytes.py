"""No bytes from a network turn into code or arbitrary objects anywhere in rayturn.

rayturn's own network paths carry JSON (HTTP), protobuf (gRPC) and msgpack
validated by ``kvstore.wire`` (the lookup socket, UCX control frames): plain
data only. This test reads every module of the package and fails on anything
that could deserialise objects (pickle and its relatives, ``torch.load``,
``numpy.load(allow_pickle=True)``, YAML's full loader, ``eval``/``exec``) or
give msgpack a hook that builds objects. Ray's own channels, which pickle, are
Ray's, authenticated by Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "cluster", "decode", "engine", "kernels", "kvstore", "prefill", "protos", "replay", "router")
TOP_MODULES = ("cli.py", "messages.py", "native_build.py", "registry.py", "settings.py")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "torch.load", "yaml.load", "yaml.unsafe_load", "yaml.full_load"}
OBJECT_HOOKS = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook"}


def sources() -> list[Path]:
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    files += [ROOT / name for name in TOP_MODULES]
    return sorted(path for path in files if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {alias.name}" for alias in node.names if alias.name.split(".")[-1] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[-1] in FORBIDDEN_MODULES or any(a.name in FORBIDDEN_MODULES for a in node.names):
                found.append(f"from {module} import ...")
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            if name in FORBIDDEN_CALLS:
                found.append(f"{name}()")
            if name.endswith(".load") and name.split(".")[0] in ("np", "numpy"):
                allow = keywords.get("allow_pickle")
                if not (isinstance(allow, ast.Constant) and allow.value is False) and allow is not None:
                    found.append(f"{name}(allow_pickle=...)")
            if name.startswith("msgpack.") and OBJECT_HOOKS & set(keywords):
                found.append(f"{name}({', '.join(sorted(OBJECT_HOOKS & set(keywords)))}=...)")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{where}: {finding}" for finding in found]


def test_the_scan_sees_the_whole_package() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in sources()}
    assert {"kvstore/wire.py", "kvstore/master_lookup.py", "kvstore/ucx_server.py", "api/ingress.py"} <= names


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "from ray import cloudpickle",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import torch\ntorch.load(f)",
        "import msgpack\nmsgpack.unpackb(data, ext_hook=hook)",
        "eval(text)",
    ],
)
def test_the_scan_catches_what_it_forbids(tmp_path: Path, snippet: str) -> None:
    module = tmp_path / "probe.py"
    module.write_text(snippet + "\n")
    assert findings(module)


def test_no_module_can_turn_bytes_into_objects() -> None:
    found = [finding for path in sources() for finding in findings(path)]
    assert found == []
