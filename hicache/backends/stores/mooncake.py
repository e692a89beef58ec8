"""The ``mooncake`` store: L3 on Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

L2 is registered with the store once (``register_buffer``); pages move zero-copy between
L2 and the store with ``batch_put_from`` / ``batch_get_into``; ``batch_is_exist`` answers
lookups. A page's name in the store is its content key in hex. Semantics we design for:
the data lives in the segments of the processes that mounted them (run a standalone
``mooncake_client`` for a store that outlives engines; ``global_segment_size`` here is 0 by
default for that reason); a put of an existing key keeps the old value (we look first and
do not write it again); the store evicts silently (a get then answers -704: the page is
MISSING, the request recomputes).

Configuration follows SGLang's ``--hicache-storage-backend-extra-config`` JSON:
``master_server_address`` (required), ``metadata_server``, ``protocol``, ``local_hostname``,
``device_name``, ``global_segment_size``, ``local_buffer_size``; plus ``connect_timeout_s``.
An unreachable store at start leaves the store unavailable (logged, in ``status()``): every
request fails at once and ``exists`` answers 0 — the engine serves on without L3.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import json
import logging
import math
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.backends.faults import FaultInjector, FaultKind
from hicache.backends.pools import HostPool
from hicache.backends.stores import at_exit
from hicache.backends.stores.base import Op, PageStatus
from hicache.errors import ConfigError, MisuseError

log = logging.getLogger(__name__)
MOONCAKE_FAULTS: tuple[FaultKind, ...] = ("eio", "slow", "hang")
OBJECT_NOT_FOUND = -704
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


# The most a size may be: Mooncake's setup takes them as uint64 and larger ones raised a
# TypeError from it, or a MemoryError from C++ for the local buffer (allocated at setup).
MAX_SIZE = 1 << 50  # 1 PiB


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a string such as ``"4gb"``, ``"512 MB"``, ``"1GiB"`` (binary
    units), at most :data:`MAX_SIZE`."""
    if isinstance(value, bool):
        raise ConfigError(f"mooncake {name} must be a size, got {value!r}")
    size = None
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"mooncake {name} must be >= 0, got {value}")
        size = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            scaled = float(m.group(1)) * _UNITS[m.group(2).lower()[:1].rstrip("b")]
            size = int(scaled) if math.isfinite(scaled) else MAX_SIZE + 1
    if size is None:
        raise ConfigError(f"mooncake {name} must be a byte count or a size like '4gb', got {value!r:.80}")
    if size > MAX_SIZE:
        raise ConfigError(f"mooncake {name} must be at most 1 PiB, got {value!r:.80}")
    return size


def _address(name: str, value: object) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value or "\x00" in value:
        raise ConfigError(f"mooncake {name} must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):  # NOTE: "²" is a digit to str.isdigit, not to int()
        raise ConfigError(f"mooncake {name} must be 'host:port', got {value!r}")
    if not 0 < int(port) < 65536:
        raise ConfigError(f"mooncake {name}: port {port} is not in [1, 65535], got {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the Mooncake master is and how this process joins the store."""

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "localhost"
    device_name: str = ""
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    connect_timeout_s: float = 10.0

    KEYS = (
        "master_server_address",
        "metadata_server",
        "protocol",
        "local_hostname",
        "device_name",
        "global_segment_size",
        "local_buffer_size",
        "connect_timeout_s",
    )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> MooncakeConfig:
        """Validate SGLang-style extra config; every problem is a ConfigError."""
        unknown = sorted(set(extra) - set(cls.KEYS), key=repr)
        if unknown:
            raise ConfigError(f"mooncake extra config: unknown keys {unknown}; known: {list(cls.KEYS)}")
        if "master_server_address" not in extra:
            raise ConfigError("mooncake extra config needs master_server_address ('host:port')")
        _address("master_server_address", extra["master_server_address"])
        for name in ("metadata_server", "protocol", "local_hostname", "device_name"):
            if name in extra and not isinstance(extra[name], str):
                raise ConfigError(f"mooncake {name} must be a str, got {extra[name]!r}")
            if "\x00" in extra.get(name, ""):  # NOTE: Mooncake's C++ would read it cut at the NUL
                raise ConfigError(f"mooncake {name} must not contain a NUL character, got {extra[name]!r}")
        protocol = extra.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        timeout = extra.get("connect_timeout_s", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 1e9:
            raise ConfigError(f"mooncake connect_timeout_s must be a positive number up to 1e9, got {timeout!r:.80}")
        return cls(
            master_server_address=extra["master_server_address"],
            metadata_server=extra.get("metadata_server", cls.metadata_server),
            protocol=protocol,
            local_hostname=extra.get("local_hostname", cls.local_hostname),
            device_name=extra.get("device_name", cls.device_name),
            global_segment_size=parse_size("global_segment_size", extra.get("global_segment_size", 0)),
            local_buffer_size=parse_size("local_buffer_size", extra.get("local_buffer_size", 16 << 20)),
            connect_timeout_s=float(timeout),
        )


def check_installed() -> None:
    """ConfigError unless the Mooncake Python package can be imported."""
    if importlib.util.find_spec("mooncake") is None:
        raise ConfigError(
            "the mooncake store needs Mooncake: pip install mooncake-transfer-engine "
            "(mooncake-transfer-engine-non-cuda on machines without CUDA)"
        )


class MooncakeStore:
    """Keyed pages in Mooncake Store (see the module docstring)."""

    kind = "mooncake"
    keyed = True
    shared = True
    remote = True

    def __init__(
        self, config: MooncakeConfig, host: HostPool, *, chunk_pages: int = 32, faults: FaultInjector | None = None
    ) -> None:
        self.config = config
        self.host = host
        self.chunk_pages = chunk_pages
        self.faults = faults or FaultInjector()
        self.bytes_per_page = host.geometry.bytes_per_page
        self._base = host.bytes.data_ptr()
        self._nbytes = host.num_pages * self.bytes_per_page
        self._store: Any = None
        self.error: str | None = None
        self.codes: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._connect()

    @property
    def available(self) -> bool:
        return self._store is not None

    # -- connecting ------------------------------------------------------------------------------

    def _connect(self) -> None:
        c = self.config
        args = [c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size, c.protocol,
                c.device_name, c.master_server_address]  # fmt: skip
        host, port = _address("master_server_address", c.master_server_address)
        try:
            socket.create_connection((host, port), timeout=min(2.0, c.connect_timeout_s)).close()
        except OSError as exc:
            return self._unavailable(f"master {c.master_server_address} unreachable: {exc}")
        # NOTE: setup() holds the GIL while it retries (for minutes against a port that
        # accepts but does not answer as a master), freezing every thread of the engine.
        # A throwaway process tries the same setup first, killed at connect_timeout_s.
        probe = _probe(args, c.connect_timeout_s)
        if probe is not None:
            return self._unavailable(probe)
        store = importlib.import_module("mooncake.store").MooncakeDistributedStore()
        try:
            rc = store.setup(*args)
        except (MemoryError, TypeError, ValueError, OverflowError) as exc:  # a size it cannot take
            _quiet_close(store)
            return self._unavailable(f"setup failed: {type(exc).__name__}: {exc}")
        if rc != 0:
            _quiet_close(store)
            return self._unavailable(f"setup failed: {rc}")
        rc = store.register_buffer(self._base, self._nbytes)
        if rc != 0:
            _quiet_close(store)
            return self._unavailable(f"register_buffer of L2 ({self._nbytes} bytes) failed: {rc}")
        self._store = store

    def _unavailable(self, why: str) -> None:
        self.error = f"mooncake store at {self.config.master_server_address}: {why}"
        log.warning("hicache L3: %s; serving without L3", self.error)

    # -- the PageStore face ------------------------------------------------------------------------

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        n = len(slots)
        return [(a, min(n, a + self.chunk_pages)) for a in range(0, n, self.chunk_pages)], n

    def exists(self, keys: Sequence[bytes]) -> int:
        found = self._call().batch_is_exist([k.hex() for k in keys])
        for i, r in enumerate(found):
            if r != 1:
                return i
        return len(found)

    def put(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        if keys is None:
            raise MisuseError("the mooncake store addresses pages by key; give keys")
        store = self._call("write")
        names = [k.hex() for k in keys]
        there = store.batch_is_exist(names)
        out = [PageStatus.EXISTS if r == 1 else PageStatus.FAILED for r in there]
        todo = [i for i, r in enumerate(there) if r != 1]
        if todo:
            bpp = self.bytes_per_page
            rcs = store.batch_put_from(
                [names[i] for i in todo], [self._base + host_pages[i] * bpp for i in todo], [bpp] * len(todo)
            )
            for i, rc in zip(todo, rcs, strict=True):
                if rc == 0:
                    out[i] = PageStatus.OK
                else:
                    self._count(rc)
        return out

    def get(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        if keys is None:
            raise MisuseError("the mooncake store addresses pages by key; give keys")
        store = self._call("read")
        bpp = self.bytes_per_page
        rcs = store.batch_get_into(
            [k.hex() for k in keys], [self._base + p * bpp for p in host_pages], [bpp] * len(keys)
        )
        out: list[PageStatus] = []
        for rc in rcs:
            if rc == bpp:
                out.append(PageStatus.OK)
            elif rc == OBJECT_NOT_FOUND:
                out.append(PageStatus.MISSING)
            else:
                self._count(rc)
                out.append(PageStatus.CORRUPT if rc >= 0 else PageStatus.FAILED)
        return out

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            thread = threading.Thread(target=_quiet_close, args=(store, self._base), daemon=True)
            thread.start()
            thread.join(5.0)  # NOTE: a dead master must not wedge shutdown
            if thread.is_alive():  # NOTE: nor may the close still be in the client at exit (a crash)
                at_exit.wait_at_exit(lambda: not thread.is_alive(), at_exit.EXIT_WAIT_S, "the mooncake store's close")

    def status(self) -> dict[str, Any]:
        with self._lock:
            codes = {str(k): v for k, v in self.codes.items()}
        return {
            "master": self.config.master_server_address,
            "protocol": self.config.protocol,
            "error": self.error,
            "error_codes": codes,
        }

    # -- internals ---------------------------------------------------------------------------------

    def _call(self, op: Op | None = None) -> Any:
        store = self._store
        if store is None:
            raise OSError(errno.ENOTCONN, self.error or "mooncake store closed")
        fault = self.faults.take(op, MOONCAKE_FAULTS) if op is not None else None
        if fault is not None:
            if fault.kind == "eio":
                raise OSError(errno.EIO, "injected EIO")
            if fault.kind == "slow":
                time.sleep(fault.delay_s)
            if fault.kind == "hang":
                self.faults.hang(fault)
        return store

    def _count(self, rc: int) -> None:
        with self._lock:
            self.codes[rc] += 1


_PROBE = """
import json, sys
from mooncake.store import MooncakeDistributedStore
args = json.loads(sys.argv[1])
args[2], args[3] = 0, 1 << 20  # no segment, a small buffer: only the connection matters
store = MooncakeDistributedStore()
print("rc", store.setup(*args), flush=True)
store.close()
"""


def _probe(args: list[Any], timeout_s: float) -> str | None:
    """None if a fresh process can set up a client with ``args`` within ``timeout_s``;
    else why not: no answer in time, the setup's error code, or the last line the probe
    printed to stderr before it exited (a client library that cannot load: blaming the
    master for it sent users looking in the wrong place)."""
    with tempfile.TemporaryFile("w+") as err:  # NOTE: a file, not a pipe: it cannot fill up
        proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, json.dumps(args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            raw = proc.stdout.readline() if ready else ""
            line = raw.split()
            if line[:1] == ["rc"]:
                return None if line[1:] == ["0"] else f"setup failed: {' '.join(line[1:])}"
            if ready and not raw:  # end of output: the probe exited without an answer
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2.0)
                err.seek(0)
                said = [x.strip() for x in err.read().splitlines() if x.strip()]
                code = proc.returncode
                return f"the setup probe exited ({code}) before an answer: {said[-1] if said else 'no output'}"
            return f"no answer from the master within {timeout_s} s (setup probe)"
        finally:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _quiet_close(store: Any, buffer: int | None = None) -> None:
    try:
        if buffer is not None:
            store.unregister_buffer(buffer)
        store.close()
    except Exception as exc:
        log.warning("hicache L3: closing the mooncake client failed: %s", exc)
