"""The reference engine: transformers models over the paged L1 pool, prefix caching
through HiCache."""

from hicache.engine.engine import Engine, EngineConfig, Output
from hicache.engine.model import PRESETS, ModelRunner, build_model, kv_geometry

__all__ = ["PRESETS", "Engine", "EngineConfig", "ModelRunner", "Output", "build_model", "kv_geometry"]
