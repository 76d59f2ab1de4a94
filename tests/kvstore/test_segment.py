"""Segment: data round trips, bounds, views, and the name's lifetime across processes.

The cross-process tests run small scripts in fresh interpreters and capture their stderr, which is
also where their resource tracker prints its warnings (it inherits the script's stderr). The scripts
load ``segment.py`` straight from its file: it imports only ``bytes_view`` from the package, and this
keeps the children fast and independent of the package's other imports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayturn.kvstore import segment as segment_module
from rayturn.kvstore.bytes_view import as_writable_view
from rayturn.kvstore.landing import copy_out
from rayturn.kvstore.segment import Segment, cleanup_stale_segments

# A prefix of this test run only, so that stale-segment cleanup never touches anyone else's segments.
PREFIX = f"rtkvtest{os.getpid()}"
SHM_DIR = Path("/dev/shm")
CHILD_TIMEOUT_S = 20

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs POSIX shared memory in /dev/shm (Linux)")


@pytest.fixture
def segment() -> Iterator[Segment]:
    with Segment.create(4096, prefix=PREFIX) as created:
        yield created


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers() -> Iterator[None]:
    yield
    leftovers = sorted(path.name for path in SHM_DIR.glob(f"{PREFIX}-*"))
    for name in leftovers:
        (SHM_DIR / name).unlink(missing_ok=True)
    assert leftovers == [], f"segments left behind: {leftovers}"


class FakeTensor:
    """Duck-types the parts of a CPU torch tensor that the segment uses."""

    def __init__(self, array: np.ndarray, *, numpy_error: Exception | None = None) -> None:
        self._array = array
        self._numpy_error = numpy_error

    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)

    def numpy(self) -> np.ndarray:
        if self._numpy_error is not None:
            raise self._numpy_error
        return self._array


# -- in-process behaviour ---------------------------------------------------------------------


def test_create_names_and_sizes_the_segment() -> None:
    with Segment.create(1000) as created:
        assert re.fullmatch(rf"rayturn-kv-{os.getpid()}-[0-9a-f]{{8}}", created.name)
        assert (created.capacity_bytes, created.owner, created.closed) == (1000, True, False)
        assert created.array.dtype == np.uint8 and created.array.shape == (1000,)
        assert created.buffer.nbytes == 1000 and not created.buffer.readonly
        assert (SHM_DIR / created.name).exists()
    assert not (SHM_DIR / created.name).exists()


def test_a_new_segment_holds_its_memory_from_the_start_and_one_that_cannot_fit_fails_at_once() -> None:
    def resident_shared_kb() -> int:
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("RssShmem:")).split()[1])

    before_kb = resident_shared_kb()
    with Segment.create(16 << 20, prefix=PREFIX):
        assert resident_shared_kb() - before_kb >= 16 << 10  # every page mapped, none written yet
    too_big = shutil.disk_usage(SHM_DIR).free + (1 << 30)
    with pytest.raises(OSError, match=r"no room for a \d+-byte KV segment in /dev/shm: lower kvstore.segment_bytes"):
        Segment.create(too_big, prefix=PREFIX)
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(f"{PREFIX}-{os.getpid()}-")]


@pytest.mark.parametrize("capacity_bytes", [0, -1])
def test_create_rejects_non_positive_capacity(capacity_bytes: int) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        Segment.create(capacity_bytes, prefix=PREFIX)


def test_create_rejects_a_prefix_with_a_slash() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Segment.create(64, prefix="a/b")


def test_bytes_round_trip(segment: Segment) -> None:
    segment.write(100, b"hello kv")
    segment.write(200, bytearray(b"\x01\x02"))
    segment.write(300, memoryview(b"mv"))
    assert segment.read(100, 8) == b"hello kv"
    assert segment.read(200, 2) == b"\x01\x02"
    assert segment.read(300, 2) == b"mv"
    assert segment.read(4096, 0) == b""


def test_numpy_round_trip(segment: Segment) -> None:
    values = np.linspace(-1, 1, 96, dtype=np.float32).reshape(8, 12)
    segment.write(64, values)
    assert segment.read(64, values.nbytes) == values.tobytes()
    landed = np.empty_like(values)
    segment.read_into(64, landed)
    np.testing.assert_array_equal(landed, values)
    raw = bytearray(values.nbytes)
    segment.read_into(64, raw)
    assert bytes(raw) == values.tobytes()


def test_non_contiguous_numpy_is_copied_in_c_order(segment: Segment) -> None:
    """Strided arrays are accepted by write/read_into and copied element-wise; as_bytes_view refuses them."""
    values = np.arange(64, dtype=np.int16).reshape(8, 8)[:, ::2]
    assert not values.flags.c_contiguous
    segment.write(10, values)  # an unaligned offset for int16 works too
    assert segment.read(10, values.nbytes) == np.ascontiguousarray(values).tobytes()
    landed = np.zeros((8, 8), dtype=np.int16)
    segment.read_into(10, landed[:, 1::2])
    np.testing.assert_array_equal(landed[:, 1::2], values)
    assert not landed[:, ::2].any()


def test_tensor_like_round_trip(segment: Segment) -> None:
    source = FakeTensor(np.arange(16, dtype=np.float64))
    segment.write(0, source)
    dest = FakeTensor(np.zeros(16, dtype=np.float64))
    segment.read_into(0, dest)
    np.testing.assert_array_equal(dest.numpy(), source.numpy())


def test_non_contiguous_tensor_is_refused(segment: Segment) -> None:
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        segment.write(0, FakeTensor(np.zeros((4, 4), dtype=np.float32)[:, ::2]))


def test_view_and_array_alias_the_segment(segment: Segment) -> None:
    window = segment.view(8, 4)
    window[:] = b"abcd"
    assert segment.read(8, 4) == b"abcd"
    assert bytes(segment.array[8:12]) == b"abcd"
    segment.array[12] = ord("e")
    assert segment.read(8, 5) == b"abcde"
    window.release()


@pytest.mark.parametrize(
    "operation",
    [
        lambda s: s.write(4095, b"ab"),
        lambda s: s.write(-1, b"a"),
        lambda s: s.read(4000, 97),
        lambda s: s.read(0, -1),
        lambda s: s.view(4096, 1),
        lambda s: s.read_into(4090, bytearray(7)),
        lambda s: s.write(4090, np.zeros((2, 8), dtype=np.uint8)[:, ::2]),
    ],
    ids=["write-past-end", "negative-offset", "read-past-end", "negative-length", "view", "read_into", "strided"],
)
def test_bounds_are_checked(segment: Segment, operation: Any) -> None:
    with pytest.raises(ValueError, match=r"offset=-?\d+ num_bytes=-?\d+ .*capacity_bytes=4096"):
        operation(segment)


def test_read_into_a_read_only_destination_is_refused(segment: Segment) -> None:
    with pytest.raises(ValueError, match="read-only"):
        segment.read_into(0, b"immutable")
    frozen = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        segment.read_into(0, frozen)


def test_close_is_idempotent_and_unlinks_for_the_owner() -> None:
    created = Segment.create(128, prefix=PREFIX)
    created.close()
    created.close()
    assert created.closed and not (SHM_DIR / created.name).exists()
    with pytest.raises(ValueError, match="closed"):
        created.read(0, 1)
    with pytest.raises(FileNotFoundError):
        Segment.attach(created.name)


def test_attacher_close_does_not_unlink() -> None:
    with Segment.create(128, prefix=PREFIX) as owner:
        owner.write(0, b"shared")
        with Segment.attach(owner.name) as attached:
            assert (attached.owner, attached.capacity_bytes) == (False, 128)
            assert attached.read(0, 6) == b"shared"
            attached.write(0, b"SH")
        assert (SHM_DIR / owner.name).exists()
        assert owner.read(0, 6) == b"SHared"


def test_close_with_a_live_view_raises_but_still_unlinks() -> None:
    created = Segment.create(128, prefix=PREFIX)
    window = created.array[:16]
    with pytest.raises(BufferError, match="alive"):
        created.close()
    assert created.closed and not (SHM_DIR / created.name).exists()
    window[0] = 1  # the mapping stays valid while the view lives
    del window


def test_attach_unknown_name_raises() -> None:
    with pytest.raises(FileNotFoundError):
        Segment.attach(f"{PREFIX}-1-doesnotexist")


# -- across processes -------------------------------------------------------------------------

_LOAD_SEGMENT = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("kv_segment", {segment_module.__file__!r})
kv_segment = importlib.util.module_from_spec(_spec)
sys.modules["kv_segment"] = kv_segment
_spec.loader.exec_module(kv_segment)
"""


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "scenario.py"
    path.write_text(_LOAD_SEGMENT + textwrap.dedent(body))
    return [sys.executable, str(path)]


def _run(command: list[str], *extra_args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command, *extra_args], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)


def test_spawned_child_attaches_reads_and_writes_back(tmp_path: Path) -> None:
    """A multiprocessing spawn child shares its parent's resource tracker: the hardest case for tracking."""
    command = _script(
        tmp_path,
        f"""
        import multiprocessing as mp
        import os

        def child(name):
            segment = kv_segment.Segment.attach(name)
            assert segment.read(0, 5) == b"owner", segment.read(0, 5)
            segment.write(5, b"+child")
            segment.close()

        if __name__ == "__main__":
            owner = kv_segment.Segment.create(1 << 20, prefix={PREFIX!r})
            owner.write(0, b"owner")
            local = kv_segment.Segment.attach(owner.name)  # an attacher in the owner's own process too
            process = mp.get_context("spawn").Process(target=child, args=(owner.name,))
            process.start()
            process.join()
            assert process.exitcode == 0, process.exitcode
            assert local.read(0, 11) == b"owner+child"
            local.close()
            assert os.path.exists("/dev/shm/" + owner.name)
            owner.close()
            print(owner.name)
        """,
    )
    result = _run(command)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no tracker KeyError traceback, no "leaked shared_memory" warning
    assert not (SHM_DIR / result.stdout.strip()).exists()


def test_independent_attacher_exit_leaves_the_segment(tmp_path: Path, segment: Segment) -> None:
    """An attacher with its own tracker (a Ray worker, say) must not unlink the owner's segment on exit."""
    segment.write(0, b"from owner")
    command = _script(
        tmp_path,
        """
        segment = kv_segment.Segment.attach(sys.argv[1])
        assert segment.read(0, 10) == b"from owner"
        segment.write(0, b"FROM")
        # exits without close()
        """,
    )
    result = _run(command, segment.name)
    assert (result.returncode, result.stderr) == (0, "")
    assert (SHM_DIR / segment.name).exists()
    assert segment.read(0, 10) == b"FROM owner"


def test_owner_exit_unlinks_while_attacher_keeps_its_mapping(tmp_path: Path) -> None:
    command = _script(
        tmp_path,
        f"""
        segment = kv_segment.Segment.create(4096, prefix={PREFIX!r})
        segment.write(0, b"persisted")
        print(segment.name, flush=True)
        sys.stdin.readline()
        # exits without close(): the atexit hook unlinks
        """,
    )
    owner = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    name = owner.stdout.readline().strip()
    attached = Segment.attach(name)
    _, stderr = owner.communicate("exit\n", timeout=CHILD_TIMEOUT_S)
    assert (owner.returncode, stderr) == (0, "")
    assert not (SHM_DIR / name).exists()
    assert attached.read(0, 9) == b"persisted"
    attached.write(0, b"P")
    attached.close()


def test_fork_child_does_not_unlink_its_parents_segment(tmp_path: Path) -> None:
    command = _script(
        tmp_path,
        f"""
        import os
        segment = kv_segment.Segment.create(4096, prefix={PREFIX!r})
        pid = os.fork()
        if pid == 0:
            segment.close()  # the child inherited an owner Segment: closing it only unmaps
            sys.exit(0)  # and runs atexit, which must not unlink either
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists("/dev/shm/" + segment.name)
        segment.close()
        assert not os.path.exists("/dev/shm/" + segment.name)
        """,
    )
    result = _run(command)
    assert (result.returncode, result.stderr) == (0, "")


def test_cleanup_removes_segments_of_killed_owners_only(tmp_path: Path, segment: Segment) -> None:
    command = _script(
        tmp_path,
        f"""
        import time
        segment = kv_segment.Segment.create(4096, prefix={PREFIX!r})
        print(segment.name, flush=True)
        time.sleep(60)
        """,
    )
    # Its own session, so that SIGKILL to the group takes its resource tracker along as well.
    owner = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    assert owner.stdout is not None
    stale_name = owner.stdout.readline().strip()
    os.killpg(owner.pid, signal.SIGKILL)
    owner.wait(timeout=CHILD_TIMEOUT_S)
    owner.stdout.close()
    assert (SHM_DIR / stale_name).exists()
    assert cleanup_stale_segments(PREFIX) == [stale_name]
    assert not (SHM_DIR / stale_name).exists()
    assert (SHM_DIR / segment.name).exists()  # ours: the owner is alive
    assert cleanup_stale_segments(PREFIX) == []


def test_bfloat16_torch_tensors_move_as_their_bytes() -> None:
    torch = pytest.importorskip("torch")
    pages = torch.randn(2, 16, dtype=torch.bfloat16)
    with Segment.create(1024) as segment:
        segment.write(0, pages)
        landed = torch.zeros_like(pages)
        segment.read_into(0, landed)
    assert torch.equal(landed, pages)
    as_writable_view(pages)[:2] = b"\x00\x00"  # the view is the tensor's own memory
    assert pages[0, 0].item() == 0.0


def test_copy_out_lands_one_range_or_many_and_refuses_ranges_outside(segment: Segment) -> None:
    """``landing.copy_out``: a lone range (a one-page get) takes its own path; both check the segment's bounds."""
    capacity = segment.array.size
    segment.array[:] = np.random.default_rng(5).integers(0, 256, capacity, dtype=np.uint8)
    out = np.zeros((3, 512), dtype=np.uint8)
    addresses = out.ctypes.data + 512 * np.arange(3, dtype=np.int64)
    copy_out(segment, np.array([[1024, 512]], dtype=np.int64), addresses[:1])
    assert bytes(out[0]) == bytes(segment.array[1024:1536]) and not out[1:].any()
    copy_out(segment, np.array([[0, 512], [512, 512], [3072, 512]], dtype=np.int64), addresses)
    assert bytes(out.reshape(-1)[:1024]) == bytes(segment.array[:1024])
    assert bytes(out[2]) == bytes(segment.array[3072:3584])
    for ranges in ([[capacity - 256, 512]], [[-8, 16]], [[0, 512], [capacity, 1]]):
        with pytest.raises(ValueError, match=f"does not fit segment {segment.name}"):
            copy_out(segment, np.array(ranges, dtype=np.int64), addresses[: len(ranges)])
