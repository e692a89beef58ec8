"""A private Mooncake Store for tests: ``mooncake_master`` and a standalone
``mooncake_client`` (holding the shared segment) on 127.0.0.1 inside a network namespace
of their own.

Mooncake's listeners bind every interface even when told 127.0.0.1, so nothing here runs
in the host's network: a holder process made with ``unshare --net`` owns the namespace
(it brings ``lo`` up with an ioctl, so no ``ip`` command is needed, and answers "is this
port open?" from inside), and every process is started in it with ``nsenter``. Every wait
is bounded; every process is stopped by its pid; the namespace ends with its last process.

    with MooncakeCluster.start(tmp_dir) as mc:
        mc.run([sys.executable, "script.py"], timeout=120)   # runs inside the namespace
        open_storage("mooncake", ..., extra=mc.extra())        # in a process started by mc
"""

from __future__ import annotations

import importlib.util
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LIBS = REPO / ".venv" / "mooncake-libs"  # libibverbs, libnl-3, libnl-route-3 (scripts/setup.sh)
READY_MARK = LIBS / "READY"  # written by setup.sh once everything is in place: tests must run
MASTER_PORT, METADATA_PORT, CLIENT_PORT = 50051, 8080, 50052

HOLDER = r"""
import fcntl, socket, struct, sys, time
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = struct.pack("16sH22x", b"lo", 0)
flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
s.close()
print("ready", flush=True)
for line in sys.stdin:  # "wait PORT SECONDS" -> "open" or "closed"; EOF (our owner gone) ends us
    _, port, seconds = line.split()
    end, state = time.monotonic() + float(seconds), "closed"
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=0.5).close()
            state = "open"
            break
        except OSError:
            time.sleep(0.05)
    print(state, flush=True)
"""


class Unavailable(Exception):
    """Mooncake or a network namespace cannot be had here; the message says why."""


def mooncake_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise Unavailable("the mooncake package is not installed (bash scripts/setup.sh installs it)")
    return Path(spec.origin).parent


def lib_dirs() -> list[str]:
    if not LIBS.is_dir():
        raise Unavailable(f"Mooncake's native libraries are missing: no {LIBS} (bash scripts/setup.sh)")
    dirs = sorted({str(p.parent) for p in LIBS.rglob("*.so*")})
    if not dirs:
        raise Unavailable(f"no shared libraries under {LIBS}")
    return dirs


def child_env() -> dict[str, str]:
    """The environment of every process in the cluster's namespace."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([*lib_dirs(), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # else the client looks for a LAN address
    env["PYTHONPATH"] = ":".join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("GLOG_minloglevel", "1")
    return env


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def stop(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(grace_s)


@dataclass
class MooncakeCluster:
    """A running master + standalone client in a private namespace (see the module doc)."""

    workdir: Path
    holder: subprocess.Popen[str]
    env: dict[str, str]
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    segment_bytes: int = 256 << 20

    @classmethod
    @contextmanager
    def start(
        cls, workdir: Path, *, segment_bytes: int = 256 << 20, timeout_s: float = 60.0
    ) -> Iterator[MooncakeCluster]:
        binaries = mooncake_dir()
        env = child_env()
        holder = cls._make_namespace(env, timeout_s)
        mc = cls(workdir, holder, env, segment_bytes=segment_bytes)
        try:
            mc._spawn(
                "master",
                [
                    str(binaries / "mooncake_master"),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={MASTER_PORT}",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={METADATA_PORT}",
                ],
            )
            mc._wait_port(MASTER_PORT, timeout_s, "mooncake_master")
            mc._wait_port(METADATA_PORT, timeout_s, "mooncake_master's metadata server")
            mc._spawn(
                "client",
                [
                    str(binaries / "mooncake_client"),
                    "--host=127.0.0.1",
                    f"--port={CLIENT_PORT}",
                    f"--global_segment_size={segment_bytes}",
                    f"--master_server_address=127.0.0.1:{MASTER_PORT}",
                    f"--metadata_server=http://127.0.0.1:{METADATA_PORT}/metadata",
                    "--protocol=tcp",
                ],
            )
            mc._wait_port(CLIENT_PORT, timeout_s, "mooncake_client")  # it listens once its segment is mounted
            yield mc
        finally:
            mc.close()

    @staticmethod
    def _make_namespace(env: dict[str, str], timeout_s: float) -> subprocess.Popen[str]:
        if shutil.which("unshare") is None or shutil.which("nsenter") is None:
            raise Unavailable("unshare/nsenter (util-linux) are not installed")
        userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        holder = subprocess.Popen(
            ["unshare", *userns, "--net", "--", sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        if _readline(holder, timeout_s) != "ready":
            stop(holder)
            err = holder.stderr.read() if holder.stderr else ""
            raise Unavailable(f"cannot make a private network namespace (unshare --net): {err.strip()[-300:]}")
        return holder

    def nsenter(self) -> list[str]:
        """The command prefix that runs a program inside the cluster's namespace."""
        userns = [] if os.geteuid() == 0 else ["--user", "--preserve-credentials"]
        return ["nsenter", "-t", str(self.holder.pid), *userns, "--net", "--"]

    def extra(self, **overrides: Any) -> dict[str, Any]:
        """``extra`` for ``open_storage("mooncake", ...)`` in a process started by :meth:`run`."""
        return {
            "master_server_address": f"127.0.0.1:{MASTER_PORT}",
            "metadata_server": f"http://127.0.0.1:{METADATA_PORT}/metadata",
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,  # the data lives in the standalone client: it outlives us
            "local_buffer_size": 16 << 20,
            **overrides,
        }

    def popen(self, argv: Sequence[str], name: str, **kw: Any) -> subprocess.Popen[str]:
        """Start ``argv`` in the namespace (stdout and stderr to ``workdir/name.log``); the
        cluster stops it at close if it is still running."""
        log = open(self.workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        try:
            proc = subprocess.Popen([*self.nsenter(), *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=REPO, text=True, **kw)  # fmt: skip
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], name: str, timeout_s: float = 180.0) -> str:
        """Run ``argv`` in the namespace to completion (bounded); its output. A non-zero exit
        raises AssertionError with the output."""
        proc = self.popen(argv, name)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = -1
        out = (self.workdir / f"{name}.log").read_text()
        if rc != 0:
            raise AssertionError(f"{name} exited with {rc}:\n{out[-4000:]}")
        return out

    def _spawn(self, name: str, argv: list[str]) -> None:
        proc = self.popen(argv, name)
        time.sleep(0.05)
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited at once:\n{(self.workdir / f'{name}.log').read_text()[-2000:]}")

    def _wait_port(self, port: int, timeout_s: float, what: str) -> None:
        assert self.holder.stdin is not None
        self.holder.stdin.write(f"wait {port} {timeout_s}\n")
        self.holder.stdin.flush()
        if _readline(self.holder, timeout_s + 5) != "open":
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.workdir.glob("*.log")))
            raise AssertionError(f"{what} did not open 127.0.0.1:{port} within {timeout_s} s\n{logs}")

    def close(self) -> None:
        """Stop every process started here (newest first), then the namespace's holder."""
        for proc in reversed(self.procs):
            stop(proc)
        self.procs.clear()
        if self.holder.stdin is not None:
            self.holder.stdin.close()  # EOF: the holder exits by itself
        stop(self.holder)
        for stream in (self.holder.stdout, self.holder.stderr):
            if stream is not None:
                stream.close()
