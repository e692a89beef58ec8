"""Can a layered forward be launched before its copies are queued?

A layered restore queues its copies first and launches the forward after, because the
forward's per-layer waits are event waits, and a wait (in a stream or in a graph) binds to
the event's record at the time it is queued or launched: launched first, it would wait for
nothing. Stream memory operations (``cuStreamWaitValue32``/``cuStreamWriteValue32``) wait
for a value in memory instead, whenever it is written. This probe asks, on the GPU:

1. does a graph's event wait bind at launch (the forward must come after the records)?
2. do value waits and writes work eagerly, and captured in a CUDA graph under torch?
3. what does a waited-for value cost the waiting stream (write -> wait released)?

Prints one line per question.
"""

from __future__ import annotations

import time

import torch
from cuda.bindings import driver as drv


def _ok(out: object) -> None:
    err = out[0] if isinstance(out, tuple) else out
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err!r}")


def wait_value(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    _ok(drv.cuStreamWaitValue32(stream.cuda_stream, addr, value, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))


def write_value(stream: torch.cuda.Stream, addr: int, value: int) -> None:
    _ok(drv.cuStreamWriteValue32(stream.cuda_stream, addr, value, 0))


def spin(stream: torch.cuda.Stream, ms: float) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1.98e6))  # type: ignore[no-untyped-call]  # cycles at ~1.98 GHz


def main() -> None:
    dev = torch.device("cuda")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    flags = torch.zeros(8, dtype=torch.int32, device=dev)
    marker = torch.zeros(1, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()

    # 1. graph event wait launched before the record
    ev = torch.cuda.Event(external=True)  # type: ignore[no-untyped-call]
    ev.record(b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=a):
        a.wait_event(ev)
        marker.add_(1)
    torch.cuda.synchronize()
    marker.zero_()
    spin(b, 200)  # b busy 200 ms; the record after it is the one a waiting graph should see
    with torch.cuda.stream(a):
        g.replay()
    ev.record(b)
    time.sleep(0.05)
    # marker read without syncing a or b: a copy on a third stream
    c = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    with torch.cuda.stream(c):
        host.copy_(marker, non_blocking=True)
    c.synchronize()
    print(
        f"1. graph event wait launched before the record: marker={int(host.item())} after 50 ms "
        f"({'binds at launch: ran without waiting' if host.item() else 'waits for the later record'})"
    )
    torch.cuda.synchronize()

    # 2a. eager value wait / write
    marker.zero_()
    flags.zero_()
    torch.cuda.synchronize()
    wait_value(a, flags.data_ptr(), 1)
    with torch.cuda.stream(a):
        marker.add_(1)
    time.sleep(0.05)
    with torch.cuda.stream(c):
        host.copy_(marker, non_blocking=True)
    c.synchronize()
    before = int(host.item())
    write_value(b, flags.data_ptr(), 1)
    a.synchronize()
    print(f"2a. eager: marker before the write {before} (want 0), after {int(marker.item())} (want 1)")

    # 2b. captured value waits (two groups), then a reset in the graph
    marker.zero_()
    flags.zero_()
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2, stream=a):
            wait_value(a, flags.data_ptr(), 1)
            marker.add_(1)
            wait_value(a, flags.data_ptr() + 4, 1)
            marker.add_(10)
            flags.zero_()
        captured = True
    except Exception as exc:
        captured = False
        print(f"2b. capture failed: {exc!r}")
    if captured:
        torch.cuda.synchronize()
        print(f"2b. after capture (nothing replayed yet): marker {int(marker.item())}, flags {flags[:2].tolist()}")
        marker.zero_()
        flags.zero_()
        torch.cuda.synchronize()
        for trial in range(3):
            with torch.cuda.stream(a):
                g2.replay()
            time.sleep(0.02)
            seen = []
            for k in range(2):
                with torch.cuda.stream(c):
                    host.copy_(marker, non_blocking=True)
                c.synchronize()
                seen.append(int(host.item()))
                spin(b, 5)
                write_value(b, flags.data_ptr() + 4 * k, 1)
                time.sleep(0.02)
            a.synchronize()
            print(
                f"2b. replay {trial}: marker before each write {seen} (want [{11 * trial}, {11 * trial + 1}]), "
                f"end {int(marker.item())} (want {11 * (trial + 1)}), flags {flags[:2].tolist()} (want [0, 0])"
            )

    # 3. latency: b writes after a spin; a waits then records; compare with an event wait
    def lat(use_values: bool) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        flags.zero_()
        torch.cuda.synchronize()
        if use_values:
            wait_value(a, flags.data_ptr(), 1)
        spin(b, 2)
        e0.record(b)
        if use_values:
            write_value(b, flags.data_ptr(), 1)
        else:
            ev2 = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev2.record(b)
            a.wait_event(ev2)
        e1.record(a)
        torch.cuda.synchronize()
        return float(e0.elapsed_time(e1)) * 1e3

    vals = sorted(lat(True) for _ in range(20))
    evs = sorted(lat(False) for _ in range(20))
    print(f"3. release latency, median us: value wait {vals[10]:.1f}, event wait {evs[10]:.1f}")


if __name__ == "__main__":
    main()
