"""The reference engine: transformers models over the paged L1 pool, prefix caching
through HiCache."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.engine.engine import Engine, EngineConfig, Output
    from hicache.engine.model import PRESETS, ModelRunner, build_model, kv_geometry

# NOTE: loaded on first use: ``python -m hicache.engine`` runs its __main__ (which answers a
# Ctrl-C during the seconds-long torch import with one line) before anything imports torch.
_FROM = {
    "Engine": "engine",
    "EngineConfig": "engine",
    "Output": "engine",
    "PRESETS": "model",
    "ModelRunner": "model",
    "build_model": "model",
    "kv_geometry": "model",
}


def __getattr__(name: str) -> object:
    where = _FROM.get(name)
    if where is None:
        raise AttributeError(f"module 'hicache.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"hicache.engine.{where}"), name)


__all__ = ["PRESETS", "Engine", "EngineConfig", "ModelRunner", "Output", "build_model", "kv_geometry"]
