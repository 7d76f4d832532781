"""`qkv.hf`, the name scripts use for Hugging Face checkpoints: the format lives in qkv.formats.hf."""
from qkv.formats.hf import convert_from_hf, is_hf_dir, load, save, supported

__all__ = ["convert_from_hf", "is_hf_dir", "load", "save", "supported"]
