"""Building and loading rayturn's native libraries: one C source each, compiled on first use, cached per host.

The CPU kernels (``kernels/native.py``) and the KV store's native reader (``kvstore/ucx_native.py``) share
this. A library goes under ``$RAYTURN_CACHE_DIR/<folder>`` (default ``~/.cache/rayturn/<folder>``), named by
a digest of whatever its build depends on (``built``). Builds are safe to run at once (several Ray actors starting
together): each compiles to a private file and renames the whole file into place. A library is loaded only
from a folder and a file that are this user's and that no one else may write, so a cache pointed at a shared
directory cannot hand this process another user's code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

BUILD_TIMEOUT_S = 120


def cache_dir(folder: str) -> Path:
    base = os.environ.get("RAYTURN_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "rayturn") / folder


def compiler() -> str | None:
    """``$CC`` (default ``cc``), else gcc or clang, as a full path; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=8)
def compiler_version(compiler_path: str) -> str:
    """The first line of ``--version``: part of a library's cache key (asked once per compiler and process)."""
    done = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout.split("\n")[0]


class BuildFailed(OSError):
    """The compiler refused the source; the message is its last line of complaint."""


def check_private(path: Path) -> None:
    """OSError unless ``path`` is this user's and neither its group nor others may write it."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not this user's alone (owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})")


def private_folder(folder: Path) -> None:
    """Make ``folder`` (mode 0700) if it is missing; take group and others' write access away from it if it is
    this user's (one made under a umask of 002 has it); then OSError unless it is this user's alone."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o022:
        os.chmod(folder, info.st_mode & 0o7755)
    check_private(folder)


def build(compiler_path: str, args: Sequence[str], libraries: Sequence[str], target: Path) -> None:
    """``compiler args -o target libraries``, through a private scratch file renamed into place. BuildFailed
    when the compiler fails (nothing is left behind then); OSError when the folder cannot be made or is not
    this user's alone."""
    private_folder(target.parent)
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler_path, *args, "-o", scratch, *libraries], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if done.returncode != 0:
            complaint = done.stderr.strip() or f"{compiler_path} exited with {done.returncode}"
            raise BuildFailed(complaint.splitlines()[-1])
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def built(
    folder: str, stem: str, key: Sequence[str], compiler_path: str, args: Sequence[str], libraries: Sequence[str]
) -> Path:
    """The library ``<stem>-<digest of key>.so`` in ``cache_dir(folder)``, built there first if it is missing
    (``key``: everything the build depends on); BuildFailed or OSError as ``build`` raises them."""
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    target = cache_dir(folder) / f"{stem}-{digest}.so"
    if not target.is_file():
        build(compiler_path, args, libraries, target)
    return target


def load(target: Path) -> ctypes.CDLL:
    """The library at ``target``, once it and its folder are this user's alone (OSError if they are not)."""
    private_folder(target.parent)
    check_private(target)
    return ctypes.CDLL(str(target))
