"""A stranger that knows no store secret cannot read or write a store process's memory through UCX.

UCX emulates remote memory access (RMA) over TCP and shared memory with active messages that name a
bare address; a context with the RMA feature serves them to anyone connected, before the store's
handshake has a say. rayturn's UCX runtime creates its context without RMA or atomics
(``ucx_features.CONTEXT_FEATURES``). Here a real UCP program (``ucx_stranger.c``, built against the
``libucx`` wheel's headers) connects to a real UcxServer in another process and asks UCX itself for
a get and a put of the server's segment, over TCP as from another host:

- against rayturn's context, neither lands, and the server keeps serving members;
- against the same server in a context with RMA on (the control, ucxx's default), the get returns
  the page's bytes and the put overwrites them: the probe is real; with RMA off but the TCP
  transport's native puts on (UCX's default), the put still lands: hence ``UCX_TCP_PUT_ENABLE=n``;
- a context someone created first with RMA on is refused at start (UnsafeUcxContext);
- the segment's native reader (``ucx_native``, a UCP context of its own on a port of its own) gives a
  stranger's get and put nothing either, and leaves its READ message, sent without the handshake,
  unanswered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SECRET = b"test-store-secret-of-32-bytes..."
SEGMENT_ID = "segment-under-test"
EPOCH = "epoch-of-the-test"
PAGE = b"another tenant's KV page: secret" * 2  # 64 bytes at PAGE_OFFSET of the segment
PAGE_OFFSET = 8192
SEGMENT_BYTES = 1 << 20
TIMEOUT_S = 60.0
PROBE_SOURCE = Path(__file__).with_name("ucx_stranger.c")


# -- the server process ------------------------------------------------------------------------------------


def _serve(mode: str) -> None:
    """Serve a segment holding PAGE; say where it is; answer "bytes" (the page now) and "stop" on stdin."""
    import ucxx

    from rayturn.kvstore import ucx_features, ucx_runtime
    from rayturn.kvstore.access import SegmentGate, StoreAuth
    from rayturn.kvstore.ucx_transport import UcxServer

    if mode == "rma":  # the control: the context ucxx makes by default
        ucx_features.CONTEXT_FEATURES = (*ucx_features.CONTEXT_FEATURES, "RMA")  # type: ignore[misc]
        ucx_features.UNSAFE_FEATURES = ()  # type: ignore[misc]
    elif mode == "tcp-put":  # the control for UCX_TCP_PUT_ENABLE: RMA off, TCP's own puts on
        ucx_runtime._UCX_REQUIRED = {}  # type: ignore[misc]
        os.environ["UCX_TCP_PUT_ENABLE"] = "y"
    elif mode == "preinitialised":
        ucxx.init()
    segment = np.zeros(SEGMENT_BYTES, dtype=np.uint8)
    segment[PAGE_OFFSET : PAGE_OFFSET + len(PAGE)] = np.frombuffer(PAGE, dtype=np.uint8)
    server = UcxServer(segment.data, gate=SegmentGate(StoreAuth(SECRET), SEGMENT_ID, EPOCH), io_timeout_s=5.0)
    try:
        host, port = server.start()
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return
    features = ucx_features.context_features()
    print(
        json.dumps(
            {
                "host": host,
                "port": port,
                "fast_port": server.fast_port,
                "address": segment.ctypes.data + PAGE_OFFSET,
                "features": features,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        if line.strip() == "bytes":
            print(segment[PAGE_OFFSET : PAGE_OFFSET + len(PAGE)].tobytes().hex(), flush=True)
        else:
            break
    server.stop()


if __name__ == "__main__":
    _serve(sys.argv[1])


# -- helpers -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stranger, compiled against the UCX this project runs (the libucx wheel's headers and libraries)."""
    import libucx

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the UCX probe")
    root = Path(libucx.__file__).parent
    binary = tmp_path_factory.mktemp("ucx-probe") / "ucx_stranger"
    subprocess.run(
        [compiler, "-O1", "-o", str(binary), str(PROBE_SOURCE), f"-I{root / 'include'}", f"-L{root / 'lib'}"]
        + ["-lucp", "-lucs", f"-Wl,-rpath,{root / 'lib'}"],
        check=True,
        timeout=TIMEOUT_S,
    )
    return binary


class Victim:
    def __init__(self, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_LOG_LEVEL": "error"},
        )
        assert self.process.stdout is not None
        self.info: dict[str, Any] = json.loads(self.process.stdout.readline() or '{"error": "no answer"}')

    def page(self) -> bytes:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("bytes\n")
        self.process.stdin.flush()
        return bytes.fromhex(self.process.stdout.readline().strip())

    def page_once_settled(self, written: bytes, within_s: float = 2.0) -> bytes:
        """The page as soon as it reads ``written``, or after ``within_s`` (a put lands after its sender returns)."""
        deadline = time.monotonic() + within_s
        page = self.page()
        while page != written and time.monotonic() < deadline:
            time.sleep(0.05)
            page = self.page()
        return page

    def close(self) -> None:
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(5)


@pytest.fixture
def victim(request: pytest.FixtureRequest) -> Iterator[Victim]:
    served = Victim(request.param)
    try:
        yield served
    finally:
        served.close()


def stranger(probe: Path, victim: Victim, op: str, *, native: bool = False) -> subprocess.CompletedProcess[str]:
    """The probe against the server's UCX listener, or (``native``) its native reader's."""
    info = victim.info
    assert "error" not in info, info
    port = info["fast_port"] if native else info["port"]
    assert port, info
    address = PAGE_OFFSET if op == "am" else info["address"]  # "am" names an offset of the segment
    # UCX's own defaults (none of this process's UCX settings), over TCP only, as from another host.
    env = {name: value for name, value in os.environ.items() if not name.startswith("UCX")}
    env.update(UCX_TLS="tcp", UCX_TCP_PUT_ENABLE="y", UCX_WARN_UNUSED_ENV_VARS="n", UCX_LOG_LEVEL="error")
    return subprocess.run(
        [str(probe), op, info["host"], str(port), hex(address), str(len(PAGE))],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


# -- tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["safe"], indirect=True)
def test_a_stranger_can_neither_read_nor_write_the_servers_memory(probe: Path, victim: Victim) -> None:
    assert "RMA" not in victim.info["features"] and "TAG" in victim.info["features"]
    read = stranger(probe, victim, "get")
    assert read.returncode != 0 and read.stdout.startswith("FAILED"), read.stdout
    assert PAGE.hex() not in read.stdout
    stranger(probe, victim, "put")  # UCX may call the put sent; the server's memory says whether it landed
    assert victim.page_once_settled(b"X" * len(PAGE)) == PAGE
    _members_still_read(victim)


@pytest.mark.parametrize("victim", ["safe"], indirect=True)
def test_a_stranger_gets_nothing_from_the_native_reader(probe: Path, victim: Victim) -> None:
    """The segment's native reader (``ucx_native``): its own UCP context, on its own port, with the same doors."""
    read = stranger(probe, victim, "get", native=True)
    assert read.returncode != 0 and PAGE.hex() not in read.stdout, read.stdout
    stranger(probe, victim, "put", native=True)
    assert victim.page_once_settled(b"X" * len(PAGE)) == PAGE
    # The reader's own READ message, with a grant nobody signed, unsigned, without the handshake: no answer.
    asked = stranger(probe, victim, "am", native=True)
    assert asked.returncode != 0 and "FAILED am: no answer" in asked.stdout, asked.stdout
    assert "READ" not in asked.stdout and PAGE.hex() not in asked.stdout
    _members_still_read(victim)


@pytest.mark.parametrize("victim", ["rma"], indirect=True)
def test_the_probe_reads_and_writes_a_server_whose_context_has_rma(probe: Path, victim: Victim) -> None:
    """The control: the same server in a context with RMA on (ucxx's default) gives its memory away."""
    assert "RMA" in victim.info["features"]
    read = stranger(probe, victim, "get")
    assert read.returncode == 0 and read.stdout.split() == ["READ", PAGE.hex()], read.stdout
    wrote = stranger(probe, victim, "put")
    assert wrote.returncode == 0 and wrote.stdout.strip() == "PUT COMPLETED", wrote.stdout
    assert victim.page_once_settled(b"X" * len(PAGE)) == b"X" * len(PAGE)


@pytest.mark.parametrize("victim", ["tcp-put"], indirect=True)
def test_the_probe_writes_a_server_whose_tcp_transport_takes_puts(probe: Path, victim: Victim) -> None:
    """The control for UCX_TCP_PUT_ENABLE=n: with RMA off but TCP's native puts on, a put still lands."""
    assert "RMA" not in victim.info["features"]
    stranger(probe, victim, "put")
    assert victim.page_once_settled(b"X" * len(PAGE)) == b"X" * len(PAGE)


@pytest.mark.parametrize("victim", ["preinitialised"], indirect=True)
def test_a_context_created_before_rayturns_with_rma_is_refused(victim: Victim) -> None:
    error = victim.info.get("error", "")
    assert error.startswith("UnsafeUcxContext") and "RMA" in error, victim.info


def _members_still_read(victim: Victim) -> None:
    """A member (the secret, a signed grant) still reads the page through the store's own protocol."""
    from rayturn.kvstore.access import StoreAuth
    from rayturn.kvstore.ucx_transport import UcxClient

    auth = StoreAuth(SECRET)
    ranges = [(PAGE_OFFSET, len(PAGE))]
    into = bytearray(len(PAGE))
    with UcxClient(auth=auth, timeout_s=TIMEOUT_S) as client:
        grant = auth.read_grant(SEGMENT_ID, EPOCH, np.array(ranges), 60)
        client.read((victim.info["host"], victim.info["port"]), ranges, [into], grant)
    assert bytes(into) == PAGE
