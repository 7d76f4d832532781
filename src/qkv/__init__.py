"""qkv: a complete Transformer system built straight from the math."""
from qkv.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError

__version__ = "0.1.0"

__all__ = ["DataConfig", "ModelConfig", "ParallelConfig", "QkvError", "RunConfig", "TrainConfig",
           "build_model", "generate", "load", "presets"]


def __getattr__(name: str):  # heavier parts load on first use
    import importlib

    if name == "build_model":
        return importlib.import_module("qkv.models").build_model
    if name == "presets":
        return importlib.import_module("qkv.presets")
    if name == "generate":
        return importlib.import_module("qkv.generate.decode").generate
    if name == "load":
        return importlib.import_module("qkv.formats").load
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
