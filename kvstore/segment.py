"""A worker's KV segment: a host-memory pool in POSIX shared memory, readable by same-node processes.

The owner creates the segment (``Segment.create``) under a name ``<prefix>-<pid>-<hex8>``; other
processes on the node map it by name (``Segment.attach``) and copy straight in and out of it.

How the lifetime of the name is handled, and why (``multiprocessing.resource_tracker``, Python 3.11):

* ``SharedMemory`` registers every block it opens — created *or attached* — with a resource tracker
  process, which unlinks whatever is still registered when its last client process exits, with a
  "leaked shared_memory objects" warning. An attacher that stays registered therefore unlinks the
  owner's live segment when it exits.
* The documented workaround, ``resource_tracker.unregister(...)`` after attaching, is only safe when
  the attacher has its own tracker. The tracker keeps a *set* of names, and processes started by
  ``multiprocessing`` (spawn, forkserver, fork) share their parent's tracker, as do two segments
  opened in one process: the attacher's unregister then deletes the owner's registration, and the
  owner's own unlink later makes the tracker print a ``KeyError`` traceback.
* So an attacher never talks to the tracker at all: ``SharedMemory(name, track=False)`` on Python
  3.13+, and before that the same ``shm_open`` + ``mmap`` that ``SharedMemory`` performs, minus
  the registration (:class:`_UntrackedAttachment`).
* The owner stays registered, so the tracker remains a backstop if the owner dies without cleaning
  up (it unlinks when the owner's process tree is gone). Normally the owner unlinks explicitly: in
  :meth:`Segment.close`, or at interpreter exit through an ``atexit`` hook for segments never
  closed. Only the creating pid unlinks, so a ``fork()`` child inheriting a ``Segment`` does not.
* ``os._exit`` and SIGKILL skip ``atexit`` (``multiprocessing`` fork children end with ``os._exit``),
  and SIGKILL of the whole process group takes the tracker along too: :func:`cleanup_stale_segments`
  unlinks segments whose owner pid is gone.

Unlinking only removes the name: processes that still have the segment mapped keep using the memory
until they close it, so owners and attachers may exit in any order.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import mmap
import os
import re
import secrets
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rayturn.kvstore.bytes_view import flat_uint8

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_PREFIX", "Segment", "cleanup_stale_segments", "owner_alive"]

DEFAULT_PREFIX = "rayturn-kv"
_SHM_DIR = "/dev/shm"
_SHM_MODE = 0o600
_CREATE_ATTEMPTS = 8


# -- opening shared memory --------------------------------------------------------------------


class _Mapping(Protocol):
    """What a Segment needs from a mapped block: ``SharedMemory`` or :class:`_UntrackedAttachment`."""

    @property
    def buf(self) -> memoryview | None: ...

    def close(self) -> None: ...


class _UntrackedAttachment:
    """``SharedMemory(name, track=False)`` for Python < 3.13 on POSIX: the same ``shm_open`` + ``mmap``,
    without registering the block with the resource tracker (see the module docstring)."""

    def __init__(self, name: str) -> None:
        posixshmem: Any = importlib.import_module("_posixshmem")  # the module SharedMemory itself uses
        fd = posixshmem.shm_open("/" + name, os.O_RDWR, mode=_SHM_MODE)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)  # mmap keeps its own duplicate of fd
        finally:
            os.close(fd)
        self._buf: memoryview | None = memoryview(self._mmap)

    @property
    def buf(self) -> memoryview | None:
        return self._buf

    def close(self) -> None:
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        self._mmap.close()


class _SharedMemory(SharedMemory):
    """``SharedMemory`` whose garbage collection tolerates arrays or views that outlive it.

    The stock ``__del__`` only swallows OSError, so collecting a block while a numpy array still
    exports its buffer (e.g. an unclosed segment at interpreter exit) prints a BufferError. The
    mapping is released anyway once the last view is gone.
    """

    def __del__(self) -> None:
        with contextlib.suppress(OSError, BufferError):
            self.close()


def _attach_untracked(name: str) -> _Mapping:
    if sys.version_info >= (3, 13):
        return _SharedMemory(name=name, track=False)
    if os.name == "nt":  # Windows blocks are never registered with a resource tracker
        return _SharedMemory(name=name)
    return _UntrackedAttachment(name)


def _reserve(shm: SharedMemory, name: str, capacity_bytes: int) -> None:
    """All of a new segment's memory now: a full /dev/shm fails here, naming the segment, not with SIGBUS on
    a later write; and resident memory holds the segment from the start rather than growing into it."""
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, capacity_bytes)
    except OSError as err:
        message = f"no room for a {capacity_bytes}-byte KV segment in {_SHM_DIR}: lower kvstore.segment_bytes"
        raise OSError(err.errno, f"{message} or give the node more shared memory ({err.strerror})") from None
    finally:
        os.close(fd)
    assert shm.buf is not None
    np.frombuffer(shm.buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # touch every page: mapped and resident


def _unlink(shm: SharedMemory) -> None:
    """Remove the block's name and its resource-tracker registration, even if the name is already gone."""
    try:
        shm.unlink()
    except FileNotFoundError:  # removed behind our back (an operator, cleanup_stale_segments)
        resource_tracker.unregister("/" + shm.name, "shared_memory")


class _OwnedSegments:
    """Blocks this process created and has not unlinked yet; whatever remains is unlinked at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, tuple[int, SharedMemory]] = {}  # name -> (creator pid, block)

    def add(self, shm: SharedMemory) -> None:
        with self._lock:
            self._by_name[shm.name] = (os.getpid(), shm)

    def pop_own(self, name: str) -> SharedMemory | None:
        """Forget ``name``; return its block if this very process created it (not a parent before fork)."""
        with self._lock:
            entry = self._by_name.pop(name, None)
        if entry is None or entry[0] != os.getpid():
            return None
        return entry[1]

    def forget_after_fork(self) -> None:
        """In a fork child: the blocks are the parent's, and the lock may have been held mid-fork."""
        self._lock = threading.Lock()
        self._by_name = {}

    def unlink_all(self) -> None:
        with self._lock:
            entries, self._by_name = list(self._by_name.values()), {}
        for creator_pid, shm in entries:
            if creator_pid == os.getpid():
                _unlink(shm)


_OWNED = _OwnedSegments()
atexit.register(_OWNED.unlink_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_OWNED.forget_after_fork)


# -- the segment ------------------------------------------------------------------------------


class Segment:
    """A shared-memory segment mapped into this process, as owner (created it) or attacher.

    Use :meth:`create` or :meth:`attach`, and :meth:`close` (or ``with``) when done. Arrays and
    memoryviews obtained from ``array``, ``buffer`` or ``view`` must be dropped before ``close``;
    otherwise ``close`` raises BufferError (an owner's name is unlinked all the same, and the
    memory is unmapped once those views are garbage collected).
    """

    def __init__(self, mapping: _Mapping, name: str, *, owner: bool) -> None:
        buffer = mapping.buf
        if buffer is None:
            raise ValueError(f"shared memory block {name!r} is already closed")
        self._mapping = mapping
        self._name = name
        self._owner = owner
        self._capacity_bytes = buffer.nbytes
        self._buffer: memoryview | None = buffer
        self._array: np.ndarray | None = np.frombuffer(buffer, dtype=np.uint8)

    @classmethod
    def create(cls, capacity_bytes: int, *, prefix: str = DEFAULT_PREFIX) -> Segment:
        """Create a segment named ``<prefix>-<pid>-<hex8>``; this process owns (and will unlink) it."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", prefix):
            raise ValueError(f"prefix must be non-empty and use only [A-Za-z0-9._-], got {prefix!r}")
        for _ in range(_CREATE_ATTEMPTS):
            name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                shm = _SharedMemory(name=name, create=True, size=capacity_bytes)
            except FileExistsError:
                continue
            _OWNED.add(shm)
            try:
                _reserve(shm, name, capacity_bytes)
            except BaseException:
                shm.close()
                if _OWNED.pop_own(name) is not None:
                    _unlink(shm)
                raise
            return cls(shm, name, owner=True)
        raise FileExistsError(f"no free segment name with prefix {prefix!r} after {_CREATE_ATTEMPTS} attempts")

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment by name (FileNotFoundError if there is none); never unlinks it."""
        return cls(_attach_untracked(name), name, owner=False)

    # -- properties ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def array(self) -> np.ndarray:
        """The whole segment as a writable 1-D uint8 numpy array (no copy)."""
        if self._array is None:
            raise ValueError(f"segment {self._name!r} is closed")
        return self._array

    @property
    def buffer(self) -> memoryview:
        """The whole segment as a writable byte memoryview (no copy)."""
        if self._buffer is None:
            raise ValueError(f"segment {self._name!r} is closed")
        return self._buffer

    # -- data ---------------------------------------------------------------------------------

    def write(self, offset: int, data: object) -> None:
        """Copy the raw bytes of ``data`` to ``[offset, offset + nbytes)``.

        ``data`` is anything ``bytes_view.as_bytes_view`` accepts. A numpy array that is not C-contiguous
        (a slice with strides) is accepted too: its elements are copied in C order straight into the
        segment, in one pass and without a temporary. Non-contiguous tensors raise ValueError.
        """
        if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
            np.copyto(self._typed_span(offset, data), data)
            return
        source = flat_uint8(data, writable=False)
        np.copyto(self._span(offset, source.size), source)

    def read_into(self, offset: int, dest: object) -> None:
        """Fill ``dest`` (a writable buffer, numpy array or CPU tensor) with the bytes at ``offset``.

        As in :meth:`write`, a non-contiguous numpy ``dest`` is filled element by element in C order.
        """
        if isinstance(dest, np.ndarray) and not dest.flags.c_contiguous:
            if not dest.flags.writeable:
                raise ValueError(f"destination array of {dest.nbytes} bytes is read-only")
            np.copyto(dest, self._typed_span(offset, dest))
            return
        target = flat_uint8(dest, writable=True)
        np.copyto(target, self._span(offset, target.size))

    def read(self, offset: int, num_bytes: int) -> bytes:
        """A copy of ``[offset, offset + num_bytes)``."""
        return self._span(offset, num_bytes).tobytes()

    def view(self, offset: int, num_bytes: int) -> memoryview:
        """A writable memoryview of ``[offset, offset + num_bytes)`` (no copy)."""
        self._check_range(offset, num_bytes)
        return self.buffer[offset : offset + num_bytes]

    def _span(self, offset: int, num_bytes: int) -> np.ndarray:
        self._check_range(offset, num_bytes)
        return self.array[offset : offset + num_bytes]

    def _typed_span(self, offset: int, like: np.ndarray) -> np.ndarray:
        """The bytes at ``offset`` seen as a C-ordered array of ``like``'s dtype and shape."""
        if like.dtype.hasobject:
            raise ValueError(f"arrays of dtype {like.dtype} hold object pointers, not raw bytes")
        return self._span(offset, like.nbytes).view(like.dtype).reshape(like.shape)

    def _check_range(self, offset: int, num_bytes: int) -> None:
        if offset < 0 or num_bytes < 0 or offset + num_bytes > self._capacity_bytes:
            raise ValueError(
                f"range offset={offset} num_bytes={num_bytes} is outside segment {self._name!r} "
                f"(capacity_bytes={self._capacity_bytes})"
            )

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment; the owner also unlinks its name. Idempotent."""
        if self._array is None:
            return
        self._array = None
        self._buffer = None
        if self._owner:
            shm = _OWNED.pop_own(self._name)
            if shm is not None:
                _unlink(shm)
        try:
            self._mapping.close()
        except BufferError as error:
            raise BufferError(
                f"segment {self._name!r} closed while arrays or memoryviews into it are alive; "
                "it is unmapped once they are gone"
            ) from error

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity_bytes={self._capacity_bytes}"
        return f"Segment(name={self._name!r}, {state}, owner={self._owner})"


# -- stale segments ---------------------------------------------------------------------------


def cleanup_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink ``/dev/shm/<prefix>-<pid>-*`` segments whose owner pid is no longer alive; return their names.

    An owner killed with SIGKILL (together with its resource tracker) leaves its segment behind.
    Linux only (``[]`` elsewhere). Only valid where ``/dev/shm`` is private to this pid namespace,
    as it is in a normal container: a segment of another namespace's live process would look stale.
    """
    if not sys.platform.startswith("linux") or not os.path.isdir(_SHM_DIR):
        return []
    removed: list[str] = []
    for name in sorted(os.listdir(_SHM_DIR)):
        if not name.startswith(f"{prefix}-") or owner_alive(name):
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:  # another process cleaned it up first
            continue
        removed.append(name)
    return removed


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` (``<prefix>-<pid>-<hex8>``) still runs.

    Same-node only; a name that does not carry a pid counts as alive.
    """
    match = _NAME_PATTERN.fullmatch(name)
    return match is None or _pid_alive(int(match.group(1)))


_NAME_PATTERN = re.compile(r".+-(\d+)-[0-9a-f]+")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would address our own process group; never treat it as dead
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
