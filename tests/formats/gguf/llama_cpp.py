"""llama.cpp as an oracle: llama-cpp-python (built from its source distribution, as .ci/run does) for logits and
greedy tokens, with or without a LoRA adapter, and llama.cpp's own convert_lora_to_gguf.py from the same source
($QKV_LLAMA_CPP, else ~/.cache/qkv-models/llama.cpp-0.3.36: vendor/llama.cpp of the sdist). Without them the
tests that need them skip with the reason; in CI (CI=true) they fail instead, as .ci/run provides both."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

VERSION = "0.3.36"
SOURCE = Path(os.environ.get("QKV_LLAMA_CPP") or Path.home() / ".cache" / "qkv-models" / f"llama.cpp-{VERSION}")
F32 = 0  # GGML_TYPE_F32: an f32 KV cache (llama.cpp's default is f16)


def missing(reason: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; .ci/run provides it, so in CI these tests must run")
    pytest.skip(reason)


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        missing(f"llama-cpp-python is not installed (CMAKE_ARGS=... pip install llama-cpp-python=={VERSION}: "
                ".ci/run's flags)")
    return llama_cpp


def require_converter() -> Path:
    script = SOURCE / "convert_lora_to_gguf.py"
    if not script.is_file():
        missing(f"no {script} (set QKV_LLAMA_CPP to vendor/llama.cpp of the llama-cpp-python {VERSION} sdist)")
    return script


def model(path: Path, lora: Path | None = None, **options):
    llama_cpp = require_llama_cpp()
    extra = {"lora_path": str(lora)} if lora else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, **extra, **options)


def session(path: Path, lora: Path | None = None):
    """llama.cpp's model of `path` with the adapter `lora` over it, keeping every position's logits and an f32 KV
    cache (llama.cpp's default is f16): one load for several logits and greedy calls."""
    return model(path, lora, logits_all=True, type_k=F32, type_v=F32)


def logits(path, ids: list[int], lora: Path | None = None) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`; `path` a model file or a session."""
    llm = session(path, lora) if isinstance(path, Path) else path
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def greedy(path, ids: list[int], tokens: int, lora: Path | None = None) -> list[int]:
    llm = session(path, lora) if isinstance(path, Path) else path
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == tokens:
            break
    return out


def convert_lora(peft_dir: Path, base_hf_dir: Path, out: Path) -> Path:
    """llama.cpp's convert_lora_to_gguf.py on a PEFT dir, the base's config from an HF dir: an F32 adapter."""
    script = require_converter()
    done = subprocess.run([sys.executable, str(script), "--base", str(base_hf_dir), "--outfile", str(out),
                           "--outtype", "f32", str(peft_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def agrees_with_hf_model(path: Path, hf_model, ids) -> float:
    """qkv reads `path` with the HF model's logits (1e-4 of the largest), and llama.cpp reads it with qkv's (1e-4,
    F32 weights): the relative difference to llama.cpp, returned."""
    import torch

    import qkv

    with torch.no_grad():
        expected = hf_model(ids).logits
        ours = qkv.load(path).model(ids)
    assert (ours - expected).abs().max() < 1e-4 * expected.abs().max()
    relative = float(np.abs(logits(path, ids[0].tolist()) - ours[0].double().numpy()).max() / ours.abs().max())
    assert relative < 1e-4, relative
    return relative
