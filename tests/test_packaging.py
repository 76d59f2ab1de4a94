"""A non-editable install has everything ``rayturn`` runs: the replay package, the console script, no ``bench/``.

The wheel is built from a copy of the source tree (so no build artefacts land
in the checkout) and unpacked, not installed: a subprocess imports it ahead of
the editable install, outside any checkout, without ``bench/`` on its path.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a wheel build needs of the tree; the rest (the venv, caches, tests, results) only slows the copy down.
NOT_COPIED = (".venv", ".git", ".typing", "build", "*.egg-info", "tests", "results", "__pycache__", ".*_cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_COPIED))
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work), "."]
    built = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (path,) = work.glob("rayturn-*.whl")
    return path


def test_the_wheel_holds_the_replay_package_and_the_console_script(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(archive.read(entry_points).decode())
    replay_modules = {f"rayturn/replay/{path.name}" for path in (ROOT / "replay").glob("*.py")}
    assert {"rayturn/replay/cli.py", "rayturn/replay/agent_sessions.py"} <= replay_modules
    assert replay_modules <= names
    assert "rayturn/cli.py" in names
    # Every package of the source tree (a folder with an __init__.py, and those under it) is in the wheel.
    packages = [folder for folder in ROOT.iterdir() if (folder / "__init__.py").is_file()]
    inits = {f"rayturn/{path.relative_to(ROOT).as_posix()}" for top in packages for path in top.rglob("__init__.py")}
    assert inits <= names, f"packages missing from pyproject.toml: {sorted(inits - names)}"
    assert not any(name.startswith(("bench/", "rayturn/bench/")) for name in names)
    assert scripts["console_scripts"]["rayturn"] == "rayturn.cli:main"


def test_the_commands_run_from_the_wheel_outside_a_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    # The editable install's finder would fill in what the wheel lacks from the checkout: drop it first.
    program = f"""
import json, sys
sys.meta_path[:] = [finder for finder in sys.meta_path if not finder.__module__.startswith("__editable__")]
import rayturn.cli, rayturn.replay.paths
try:
    code = rayturn.cli.main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
outside = [name for name, module in sys.modules.items()
           if name.startswith("rayturn") and not (getattr(module, "__file__", None) or "").startswith({str(site)!r})]
on_path = [entry for entry in sys.path if entry.rstrip("/").endswith("bench")]
checkout = rayturn.replay.paths.CHECKOUT
print(json.dumps({{"outside": outside, "bench_on_path": on_path, "checkout": str(checkout)}}))
sys.exit(code)
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = [sys.executable, "-c", program]
    replay = subprocess.run([*run, "replay", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.startswith("usage: rayturn replay")
    assert json.loads(replay.stdout.strip().splitlines()[-1]) == {
        "outside": [],
        "bench_on_path": [],
        "checkout": "None",
    }
    # No traces next to the current directory: sample ones, written with the results, relative to it too
    # (the replay itself then starts a cluster: tests/replay/test_replay_quick.py runs that).
    lookup = """
import json, sys
sys.meta_path[:] = [finder for finder in sys.meta_path if not finder.__module__.startswith("__editable__")]
from rayturn.replay import cli
paths, sample = cli.trace_paths(cli.parse_args(["--quick"]))
print(json.dumps({"paths": [str(path) for path in paths], "sample": sample, "module": cli.__file__}))
"""
    found = subprocess.run([sys.executable, "-c", lookup], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    looked_at = (tmp_path.parent / "shared" / "traces" / "weka").resolve()
    assert f"no traces at {looked_at}: replaying 6 generated sample conversations" in found.stderr
    samples = Path("bench", "results", "replay", "sample_traces")
    assert json.loads(found.stdout) == {
        "paths": [str(samples)],
        "sample": True,
        "module": str(site / "rayturn/replay/cli.py"),
    }
    assert len(list((tmp_path / samples).glob("sample_*.json"))) == 6
    bench = subprocess.run([*run, "bench", "--quick", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bench.returncode == 0, bench.stderr
    assert bench.stdout.startswith("usage: rayturn bench")
    assert json.loads(bench.stdout.strip().splitlines()[-1])["outside"] == []
