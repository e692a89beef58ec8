"""Layer signals: "layer group g has landed", as a value in device memory.

A layered restore's forward waits, at each layer, for that layer's pages. With CUDA events
the forward must be launched after the copy has recorded them all (a wait binds to the
record made before it was queued, or before its graph was launched), so it starts only once
the host has queued every copy of the restore. A value wait (``cuStreamWaitValue32``) waits
for a write made at any time: the forward is launched first and its first layer runs as
soon as the first group lands, while the host is still queuing the rest.

The protocol, per layered restore (the engine starts one only when the previous one's
consumer has finished, :attr:`ModelRunner.layered_busy`):

- :meth:`LayerSignals.arm` on the host; the copy (the producer) records each group's signal
  once, on its stream, after that group's pages (``signal.record(stream)``: writes 1);
- exactly one consumer on the runner's side stream waits for every group (a forward,
  ``signal.wait(stream)`` per layer, or :meth:`ModelRunner.drain`) and then zeroes them all
  (:meth:`LayerSignals.reset`), so the next restore starts from zeros;
- whatever the producer did not record (a copy that failed part-way) the engine records
  with :meth:`LayerSignals.fill` once the producer is done: every signal is written exactly
  once per round, so a consumer never waits forever and no late write survives a reset.

A second record of one signal in a round is ignored: written again after the consumer's
reset it would let the next round's forward read pages that have not landed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from hicache.backends import dma


class LayerSignal:
    """One layer group's signal; :class:`LayerSignals` hands one object per layer (a group's
    layers share it). Duck-types the two ``torch.cuda.Event`` calls a layered H2D and a
    layered forward make: ``record(stream)`` and ``wait(stream)``."""

    __slots__ = ("group", "owner")

    def __init__(self, owner: LayerSignals, group: int) -> None:
        self.owner, self.group = owner, group

    def record(self, stream: Any = None) -> None:
        self.owner.record(self.group, stream)

    def wait(self, stream: Any = None) -> None:
        self.owner.wait(self.group, stream)


class LayerSignals:
    """One 32-bit flag per layer group on ``device`` and the host's record of which were
    written this round (module docstring). ``write``/``wait_for`` (tests) replace the
    driver's stream memory operations: ``(stream, address, value)``."""

    def __init__(
        self,
        groups: Sequence[tuple[int, int]],
        device: torch.device,
        *,
        write: Any = None,
        wait_for: Any = None,
    ) -> None:
        self.groups = list(groups)
        self.flags = torch.zeros(len(self.groups), dtype=torch.int32, device=device)
        self._write = write or dma.write_value
        self._wait = wait_for or dma.wait_value
        self._recorded = [False] * len(self.groups)
        self.events: tuple[LayerSignal, ...] = tuple(
            signal for g, (lo, hi) in enumerate(self.groups) for signal in [LayerSignal(self, g)] * (hi - lo)
        )
        self.ignored = 0  # second records of a signal in one round (not written)

    def _at(self, group: int) -> int:
        return self.flags.data_ptr() + 4 * group

    def _stream(self, stream: Any) -> Any:
        if stream is None and self.flags.is_cuda:
            return torch.cuda.current_stream(self.flags.device)
        return stream

    def arm(self) -> None:
        """Start a round: no signal recorded yet (host side; the flags are zero since the
        last consumer's reset)."""
        self._recorded = [False] * len(self.groups)

    def record(self, group: int, stream: Any = None) -> None:
        """Queue on ``stream`` (default: the current one) the write of ``group``'s flag, once
        per round."""
        if self._recorded[group]:
            self.ignored += 1
            return
        self._write(self._stream(stream), self._at(group), 1)
        self._recorded[group] = True  # NOTE: after the write: a failed one is left to fill()

    def wait(self, group: int, stream: Any = None) -> None:
        """Queue on ``stream`` a wait until ``group``'s flag is written."""
        self._wait(self._stream(stream), self._at(group), 1)

    @property
    def recorded_any(self) -> bool:
        """Whether the producer recorded any signal this round."""
        return any(self._recorded)

    @property
    def recorded_all(self) -> bool:
        return all(self._recorded)

    def fill(self, stream: Any = None) -> int:
        """Record, on ``stream``, every signal not recorded this round; how many. Only once
        the producer is done with them (it records no more)."""
        missing = [g for g, done in enumerate(self._recorded) if not done]
        for g in missing:
            self.record(g, stream)
        return len(missing)

    def reset(self, stream: Any = None) -> None:
        """Zero every flag on ``stream``: the consumer's last step, after its waits."""
        with torch.cuda.stream(self._stream(stream)) if self.flags.is_cuda else contextlib.nullcontext():
            self.flags.zero_()

    def wait_all(self, stream: Any = None) -> None:
        for g in range(len(self.groups)):
            self.wait(g, stream)


def probe(signals: LayerSignals, stream: Any) -> bool:
    """Whether the device runs the value operations: write, wait, reset on ``stream``, then
    block until done (a device that cannot raises here, before any forward depends on it)."""
    try:
        signals.arm()
        signals.fill(stream)
        signals.wait_all(stream)
        signals.reset(stream)
        stream.synchronize()
        signals.arm()
        return bool(int(signals.flags.sum().item()) == 0)
    except Exception:
        return False
