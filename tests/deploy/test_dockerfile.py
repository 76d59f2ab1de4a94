"""deploy/docker/Dockerfile, read as Docker reads it (no Docker here): on the Ray base image of the manifests,
installing the package this project builds from files that are in the build context, serving with a command
the package installs."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rayturn.api.grpc_service import SERVICER_FUNCTION
from rayturn.cluster.kuberay import RAY_VERSION

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
INSTRUCTIONS = {"ARG", "FROM", "RUN", "COPY", "ADD", "WORKDIR", "ENV", "CMD", "ENTRYPOINT", "USER", "LABEL", "EXPOSE"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Docker's reading: comments dropped, ``\\``-continued lines joined, one instruction per logical line."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        continued = line.endswith("\\")
        pending.append(line[:-1].strip() if continued else line)
        if continued:
            continue
        keyword, _, arguments = " ".join(pending).partition(" ")
        if keyword.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {start}: unknown instruction {keyword!r}")
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
        pending = []
    if pending:
        raise ValueError("the last instruction ends in a line continuation")
    return instructions


def build_args(instructions: list[Instruction]) -> dict[str, str]:
    found = {}
    for instruction in instructions:
        if instruction.keyword == "ARG":
            name, _, default = instruction.arguments.partition("=")
            found[name] = default
    return found


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda match: variables[match[1] or match[2]], text)


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse(DOCKERFILE.read_text())


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(relative: str) -> bool:
    patterns = _dockerignore()
    parts = relative.split("/")
    prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pattern.removeprefix("**/")) or fnmatch.fnmatch(prefix, pattern)
        for pattern in patterns
        for prefix in prefixes
    )


def test_parser_reads_continuations_and_refuses_nonsense() -> None:
    parsed = parse("# c\nFROM x\nRUN a \\\n  # inside\n  && b\n")
    assert [(i.keyword, i.arguments, i.line) for i in parsed] == [("FROM", "x", 2), ("RUN", "a && b", 3)]
    with pytest.raises(ValueError, match="unknown instruction 'FORM'"):
        parse("FORM x\n")


def test_base_is_the_official_ray_image_of_the_manifests(instructions: list[Instruction]) -> None:
    args = build_args(instructions)
    assert args["RAY_VERSION"] == RAY_VERSION
    (base,) = [expand(i.arguments, args) for i in instructions if i.keyword == "FROM"]
    assert base == f"rayproject/ray:{RAY_VERSION}-py311"
    gpu_base = expand(next(i.arguments for i in instructions if i.keyword == "FROM"), {**args, "RAY_VARIANT": "-gpu"})
    assert gpu_base == f"rayproject/ray:{RAY_VERSION}-py311-gpu"


def test_pip_installs_the_package_the_project_builds(instructions: list[Instruction]) -> None:
    project = importlib.metadata.metadata("rayturn")
    args = build_args(instructions)
    (run,) = [i for i in instructions if i.keyword == "RUN" and "pip install" in i.arguments]
    commands = [shlex.split(expand(part, args)) for part in run.arguments.split("&&")]
    requirements = [Requirement(words[-1]) for words in commands if words[:2] == ["pip", "install"]]
    names = [requirement.name for requirement in requirements]
    assert project["Name"] in names
    (package,) = [requirement for requirement in requirements if requirement.name == project["Name"]]
    copied_to = [i.arguments.split()[-1] for i in instructions if i.keyword == "COPY"]
    assert package.url == f"file://{copied_to[0]}"
    # The torch the project is tested with (the Makefile's pin), within the package's own requirement.
    (torch,) = [requirement for requirement in requirements if requirement.name == "torch"]
    makefile_pin = re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert makefile_pin is not None and str(torch) == makefile_pin[1]
    (torch_version,) = [spec.version for spec in torch.specifier]
    (needed,) = [
        Requirement(dependency)
        for dependency in project.get_all("Requires-Dist") or []
        if dependency.startswith("torch")
    ]
    assert needed.specifier.contains(torch_version)


def test_the_build_imports_the_grpc_servicer(instructions: list[Instruction]) -> None:
    (run,) = [i for i in instructions if i.keyword == "RUN" and "pip install" in i.arguments]
    servicer_module = SERVICER_FUNCTION.rpartition(".")[0]
    assert f"import {servicer_module}" in run.arguments or f" {servicer_module}," in run.arguments


def test_every_copy_source_is_in_the_build_context(instructions: list[Instruction]) -> None:
    copies = [i for i in instructions if i.keyword in ("COPY", "ADD")]
    assert copies
    for copy in copies:
        *sources, _ = [word for word in copy.arguments.split() if not word.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"line {copy.line}: COPY source {source} does not exist"
    for needed in ("pyproject.toml", "README.md", "cli.py", "protos/rayturn_pb2_grpc.py", "cluster/app.py"):
        assert (REPO / needed).exists() and not _ignored(needed), f"{needed} must reach the image"
    for left_out in (".venv/bin/python", "tests/conftest.py", ".mypy_cache/x", "api/__pycache__/x.pyc"):
        assert _ignored(left_out), f"{left_out} must stay out of the build context"


def test_the_command_is_a_script_the_package_installs(instructions: list[Instruction]) -> None:
    scripts = {entry.name: entry for entry in importlib.metadata.entry_points(group="console_scripts")}
    (command,) = [i for i in instructions if i.keyword in ("CMD", "ENTRYPOINT")]
    argv = json.loads(command.arguments)
    assert argv[0] in scripts and scripts[argv[0]].dist is not None and scripts[argv[0]].dist.name == "rayturn"
    assert callable(scripts[argv[0]].load())
