"""Run a program in a fresh interpreter whose import of a module is interrupted (Ctrl-C)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_INTERRUPT = """\
import sys, runpy
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
sys.modules.pop({module!r}, None); sys.meta_path.insert(0, Interrupt())
"""


def run_with_import_interrupted(code: str, module: str = "torch") -> subprocess.CompletedProcess[str]:
    """Run ``code`` (which may use ``sys`` and ``runpy``) from the checkout's root, with
    the checkout first on the path and a KeyboardInterrupt at the first import of ``module``
    (by default torch, the import that takes seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", _INTERRUPT.format(module=module) + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
