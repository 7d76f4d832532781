"""LoRA adapters as GGUF files, the form llama.cpp applies over a base model at run time (`llama-cli -m BASE.gguf
--lora ADAPTER.gguf`, `llama-server --lora`, llama-cpp-python's `Llama(model_path, lora_path=...)`, Ollama's
ADAPTER), written as llama.cpp's own convert_lora_to_gguf.py writes them and read from either:

    general.architecture  the base's (llama.cpp refuses an adapter of another architecture)
    general.type          "adapter"
    adapter.type          "lora"
    adapter.lora.alpha    float32; llama.cpp scales each pair by alpha / r, r its own rank (alpha 0: by 1)
    BASE.lora_a           A (r, K)  for each adapted base tensor BASE (`blk.3.attn_q.weight`), named as the base
    BASE.lora_b           B (N, r)  file names it; GGUF's shapes list these reversed: ne = [K, r] and [r, N]

What the base file's layout does to a weight it does to B alone, because it acts on the output rows: llama.cpp
permutes the rows of LLaMA's Q and K (qkv.formats.gguf.archs.permute), so the B of q_proj and k_proj goes out
permuted the same way and is unpermuted on reading (W + s B A with W's rows permuted is P W + s (P B) A).

rsLoRA (PEFT's use_rslora, s = alpha / sqrt(r)) has no key of its own here: qkv writes alpha = s r, which
llama.cpp's formula turns back into s. (llama.cpp's own converter writes PEFT's lora_alpha as it is, so the
adapters it converts from an rsLoRA dir are scaled by alpha / r, sqrt(r) times too little.)
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.files import read_json
from qkv.formats.gguf.archs import GGUF_ARCHS, GGUF_NAMES
from qkv.formats.gguf.reader import GgufFile, is_gguf
from qkv.formats.gguf.writer import gguf_file
from qkv.formats.hf import exporter
from qkv.formats.lora import Adapter, LoraPair, check_adapter, hf_modules

DTYPES = ("f32", "f16", "bf16")  # an adapter's matrices (llama.cpp adds their product in f32)
PARTS = (".lora_a", ".lora_b")


def is_adapter(path: str | Path) -> bool:
    """A GGUF file whose general.type says it is an adapter (read from its header alone)."""
    try:
        return GgufFile.open(Path(path)).metadata.get("general.type") == "adapter"
    except QkvError:
        return False


def base_arch(cfg: ModelConfig, name: str | None = None):
    """(llama.cpp's name of the base's architecture, its GGUF entry, the HF config dict it goes out as). `name`:
    the base file's own (base_file_arch), else the one qkv would write the model as."""
    _, hf = exporter(cfg).hf_config(cfg)
    name = name or GGUF_NAMES.get(hf["model_type"], hf["model_type"])
    if name not in GGUF_ARCHS or GGUF_ARCHS.get(name).gguf_name is None:
        writes = [n for n in GGUF_ARCHS.names() if GGUF_ARCHS.get(n).gguf_name is not None]
        raise QkvError(f"a {name} model's adapters have no GGUF form in qkv (it writes them for {', '.join(writes)})")
    return name, GGUF_ARCHS.get(name), hf


def base_file_arch(path: str | Path) -> str | None:
    """The GGUF architecture of the base model at `path`, where the file says it: a GGUF file's own, an HF dir's
    model_type as llama.cpp names it, a qkv run's --init model's; None for a model qkv made (then the one qkv
    writes it as). A Qwen2 file and a LLaMA with biases are one model to qkv, but not to llama.cpp, which
    refuses an adapter of another architecture and permutes LLaMA's Q and K rows only."""
    path = Path(path)
    if path.is_file() and is_gguf(path):
        name = GgufFile.open(path).get("general.architecture")
        return name if isinstance(name, str) else None
    if (path / "config.json").is_file():
        raw = read_json(path / "config.json")
        if isinstance(raw, dict) and isinstance(raw.get("model_type"), str):
            return GGUF_NAMES.get(raw["model_type"], raw["model_type"])
        init = raw.get("train", {}).get("init") if isinstance(raw, dict) and isinstance(raw.get("train"), dict) else None
        if isinstance(init, str) and init and Path(init).exists() and Path(init).resolve() != path.resolve():
            return base_file_arch(init)
    return None


def read_adapter(path: str | Path, cfg: ModelConfig, base: str | None = None) -> Adapter:
    """The GGUF adapter at `path` as an Adapter for a model of `cfg` (checked: qkv.formats.lora.check_adapter);
    `base`: the base file's architecture (base_file_arch), which the adapter must be for."""
    path = Path(path)
    file = GgufFile.open(path)
    meta = file.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise QkvError(f"{path}: not a GGUF LoRA adapter (general.type={meta.get('general.type')!r}, "
                       f"adapter.type={meta.get('adapter.type')!r}; an adapter says 'adapter' and 'lora')")
    if "adapter.alora.invocation_tokens" in meta:
        raise QkvError(f"{path}: an activated LoRA (adapter.alora.invocation_tokens), which qkv does not apply")
    alpha = meta.get("adapter.lora.alpha")
    if alpha is None:
        raise QkvError(f"{path}: has no adapter.lora.alpha, the scale of its update")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise QkvError(f"{path}: adapter.lora.alpha={alpha!r} must be a number >= 0")
    name, arch, hf = base_arch(cfg, base)
    if meta.get("general.architecture") != name:
        raise QkvError(f"{path}: an adapter for a {meta.get('general.architecture')!r} model; this model is {name!r}")
    modules = {hf_name: qkv_name for qkv_name, hf_name in hf_modules(cfg).items()}
    targets = {}
    for tensor in file.names:
        target, part = tensor[:-len(PARTS[0])], tensor[-len(PARTS[0]):]
        if part not in PARTS:
            raise QkvError(f"{path}: holds {tensor!r}, which is no LoRA tensor (BASE.lora_a or BASE.lora_b)")
        targets.setdefault(target, set()).add(part)
    layers = {}
    for target, parts in targets.items():  # each adapted base tensor
        if parts != set(PARTS):
            raise QkvError(f"{path}: {target} has {sorted(parts)[0]} without its other half")
        hf_name = arch.hf_name(target)
        qkv_name = modules.get(hf_name.removesuffix(".weight")) if hf_name else None
        if qkv_name is None:
            raise QkvError(f"{path}: adapts {target}, which is no linear layer of this model's blocks that qkv "
                           "adapts (an adapter for another base?)")
        a, b = file.tensor(target + PARTS[0]), file.tensor(target + PARTS[1])
        try:
            b = arch.to_hf(hf_name, b, hf) if a.ndim == b.ndim == 2 else None
        except ValueError:  # rows Q's heads cannot be unpermuted in
            b = None
        if b is None:
            raise QkvError(f"{path}: {target}'s lora_a {tuple(a.shape)} and lora_b "
                           f"{tuple(file.tensor(target + PARTS[1]).shape)} are not (r, K) and (N, r) for this model")
        rank = a.shape[0]
        scaling = float(alpha) / rank if alpha and rank else 1.0  # llama.cpp: alpha 0 means no scaling
        layers[qkv_name] = LoraPair(A=torch.from_numpy(np.ascontiguousarray(a)),
                                    B=torch.from_numpy(np.ascontiguousarray(b)), scaling=scaling)
    return check_adapter(Adapter(layers=layers, origin=str(path)), cfg)


def save_adapter(adapter: Adapter, cfg: ModelConfig, out: str | Path, dtype: str = "f32",
                 name: str | None = None, base: str | None = None) -> Path:
    """Write `adapter` (checked against `cfg`) as a GGUF adapter at `out` for a base file of architecture `base`
    (base_file_arch; None: the one qkv writes the model as), next to `out` and renamed into place: an existing
    file is never overwritten."""
    import gguf

    out = Path(out)
    if dtype not in DTYPES:
        raise QkvError(f"--dtype {dtype} for an adapter: choose from {', '.join(DTYPES)} (llama.cpp adds A and B's "
                       "product in float; a quantized rank-r matrix saves nothing worth its error)")
    if out.exists():
        raise QkvError(f"{out} already exists; choose another file")
    check_adapter(adapter, cfg)
    arch_name, arch, hf = base_arch(cfg, base)
    alphas = {pair.scaling * pair.rank for pair in adapter.layers.values()}
    alpha = next(iter(alphas))
    if max(alphas) - min(alphas) > 1e-6 * max(alphas):
        raise QkvError(f"{adapter.origin}: its layers' scalings s are not one alpha / r (llama.cpp's one "
                       "adapter.lora.alpha cannot say them)")
    names = hf_modules(cfg)
    kind = gguf.GGMLQuantizationType[dtype.upper()]
    with gguf_file(out, arch_name) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        if name:
            writer.add_name(name)
        for qkv_name, pair in adapter.layers.items():
            hf_name = names[qkv_name] + ".weight"
            target = arch.gguf_name(hf_name)  # the base tensor this pair adapts
            a, b = pair.A.detach().float().cpu().numpy(), pair.B.detach().float().cpu().numpy()
            stored_b = arch.from_hf(hf_name, b, hf)
            if not np.allclose(arch.from_hf(hf_name, b @ a, hf), stored_b @ a, rtol=1e-5, atol=1e-6):
                raise QkvError(f"{target}: the base file stores this weight in a way an adapter's B cannot follow")
            add_matrix(writer, target + PARTS[0], a, kind)
            add_matrix(writer, target + PARTS[1], stored_b, kind)
    return out


def add_matrix(writer, name: str, w: np.ndarray, kind) -> None:
    """A matrix in f32, f16 or bf16 whatever its row length (add_tensor keeps f32 where blocks do not fit)."""
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind), raw_dtype=kind)
