"""Ctrl-C held back across the controller's bookkeeping.

Python runs a signal's handler between two bytecodes of the main thread, so a Ctrl-C can
raise ``KeyboardInterrupt`` in the middle of a call that moves pages between the tree, a
request and a transfer: half-done, the pages of the step not yet taken stay held forever,
or belong to two owners. Inside :func:`atomic` a SIGINT is only noted; when the section
ends, the handler that was in place gets it (``signal.raise_signal``), so it runs exactly as
it would have, one section later: Python's own raises ``KeyboardInterrupt`` from the call
that was running, with everything the call did done.

Only the main thread receives signals, so elsewhere there is nothing to hold. Sections nest
(the innermost is a no-op). A handler installed from C (``getsignal`` is None) is left as it
is: it cannot be put back. Waits that may take long (a blocking restore, ``drain``) are not
held: they change nothing until a copy has landed, and what runs after that is.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_MAIN = threading.main_thread()


class _Held:
    """The handler SIGINT had before the outermost section, and whether one came since."""

    depth = 0
    came = False


def _note(signum: int, frame: FrameType | None) -> None:
    _Held.came = True


def atomic(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs with SIGINT held (module docstring)."""

    @functools.wraps(fn)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        if _Held.depth or threading.current_thread() is not _MAIN:
            return fn(*args, **kwargs)
        before: Any = signal.getsignal(signal.SIGINT)
        if before is None or before is _note:  # NOTE: set from C (cannot be put back), or ours
            return fn(*args, **kwargs)
        signal.signal(signal.SIGINT, _note)
        _Held.depth, _Held.came = 1, False
        try:
            return fn(*args, **kwargs)
        finally:
            _Held.depth = 0
            signal.signal(signal.SIGINT, before)
            if _Held.came:
                _Held.came = False
                signal.raise_signal(signal.SIGINT)  # NOTE: the handler runs as this call returns

    return held
