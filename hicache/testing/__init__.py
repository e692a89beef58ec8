"""Reusable test machinery for embedders: fake backends and hypothesis state machines.

Needs the ``hypothesis`` package (``pip install hicache[dev]``).
"""

from hicache.testing.fake_backend import POISON, FakeBackend, page_tag

__all__ = ["POISON", "FakeBackend", "page_tag"]
