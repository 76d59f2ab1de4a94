"""Native libraries are loaded only from a folder and a file that are this user's alone.

Both native libraries (the CPU kernels and the KV store's reader) are built into a cache that
``RAYTURN_CACHE_DIR`` may point anywhere, a shared directory included; a library another user could have
written or replaced would run as this process. So the cache folder is made 0700, a folder of this user's that
others may write loses that, and a library file that is not this user's, or that others may write, is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rayturn import native_build
from rayturn.kernels import native

SOURCE = "int answer(void) { return 42; }\n"


def built(folder: Path) -> Path:
    source = folder.parent / "answer.c"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(SOURCE)
    compiler = native_build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    target = folder / "answer.so"
    native_build.build(compiler, ["-shared", "-fPIC", str(source)], [], target)
    return target


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_library_built_into_a_new_folder_loads_and_is_private(tmp_path: Path) -> None:
    target = built(tmp_path / "cache" / "kernels")
    assert mode(target.parent) == 0o700 and not mode(target) & 0o022
    assert native_build.load(target).answer() == 42
    assert sorted(p.name for p in target.parent.iterdir()) == ["answer.so"]  # no scratch file left


def test_a_folder_of_this_users_that_others_may_write_is_tightened_before_loading(tmp_path: Path) -> None:
    target = built(tmp_path / "kernels")
    os.chmod(target.parent, 0o777)  # as a umask of 000 (or 002: 0o775) would have made it
    assert native_build.load(target).answer() == 42
    assert mode(target.parent) == 0o755


def test_a_library_others_may_write_is_refused(tmp_path: Path) -> None:
    target = built(tmp_path / "kernels")
    os.chmod(target, 0o666)
    with pytest.raises(OSError, match="is not this user's alone"):
        native_build.load(target)


def test_a_library_or_folder_of_another_users_is_refused(tmp_path: Path) -> None:
    target = built(tmp_path / "kernels")
    other = os.getuid() + 4242
    try:
        os.chown(target, other, -1)
    except PermissionError:
        pytest.skip("only root can give a file away")
    with pytest.raises(OSError, match=f"owner uid {other}"):
        native_build.load(target)
    os.chown(target, os.getuid(), -1)
    os.chown(target.parent, other, -1)
    with pytest.raises(OSError, match=f"owner uid {other}"):
        native_build.load(target)  # a folder not ours is not tightened, only refused
    with pytest.raises(OSError, match=f"owner uid {other}"):
        native_build.build(native_build.compiler() or "cc", ["-shared"], [], target.parent / "new.so")


def test_the_cpu_kernels_skip_a_cached_library_others_may_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The kernels' own library, made writable by others after it was built, is not loaded: the build with the
    portable flags is, or the torch backend serves where that fails too."""
    monkeypatch.setenv("RAYTURN_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        first = native.load()
        assert first is not None and first.path.parent == tmp_path / "kernels"
        os.chmod(first.path, 0o666)
        native.load.cache_clear()
        second = native.load()
    finally:
        native.load.cache_clear()
        native._unavailable.clear()
    assert second is not None and second.path != first.path  # the portable build, not the writable file
