"""GGUF files (llama.cpp, Ollama, LM Studio) in and out: a model, its tokenizer and its chat template in one file.

    run = qkv.load("SmolLM2-135M-Instruct.Q4_1.gguf")    # the same Run as a run dir or an HF dir gives
    qkv convert --from-gguf FILE.gguf --out RUN          # a qkv run dir
    qkv convert RUN --to-gguf OUT.gguf --dtype q8_0      # llama- or gpt2-shaped runs, for llama.cpp (writer)

Reading: the file is checked and parsed by `reader` (the `gguf` package's memory map); each architecture
(`archs.GGUF_ARCHS`) turns its metadata and tensors into the Hugging Face checkpoint llama.cpp converted them
from (llama.cpp's Q/K row permutation undone), which the HF family's own rules map to qkv. With `shipped` (the
default of generate, chat, serve and eval) a linear layer stored in a quantized block type keeps its blocks
(`blocks`: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0); every other tensor of a type the `gguf` package
knows (F32, F16, BF16, Q2_K, Q3_K, IQ*, ...) is dequantized by it to float32. The tokenizer comes from `tokenizer.ggml.*` (`tokenizer`), the chat template from
`tokenizer.chat_template`, the ids that end a turn from the EOS (and end-of-turn) token ids.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.files import assign_model_tensors
from qkv.formats.base import Chat, Run, check_vocabulary, model_with
from qkv.formats.gguf import deepseek, gemma, gpt_oss, llama_kin, moe  # noqa: F401  (register deepseek2, gemma2,
# gemma3, gpt-oss, smollm3, phi3, qwen3moe, olmoe: assembled here)
from qkv.formats.gguf.archs import GGUF_ARCHS
from qkv.formats.gguf.blocks import SHIPPED_TYPES, Shipped, read_shipped, shippable
from qkv.formats.gguf.reader import GgufFile, is_gguf
from qkv.formats.gguf.tokenizer import cached_tokenizer, token_of
from qkv.formats.gguf.writer import save
from qkv.formats.hf import run_config
from qkv.formats.hf.common import HF_FAMILIES
from qkv.models import build_model
from qkv.models.build import check_model
from qkv.nn.embedding import QuantEmbedding

__all__ = ["config", "detect", "is_gguf", "load", "save"]


def detect(path: Path) -> bool:
    """A file named .gguf (read as one, so that a damaged one says what is wrong), or one with its magic."""
    path = Path(path)
    return path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf(path))


def load(path: str | Path, device: str | torch.device = "cpu", *,
         convert: Callable[[nn.Module], None] | None = None, shipped: bool = False) -> Run:
    """A GGUF file as a Run: the model in eval mode (fp32 weights), its tokenizer and chat. `convert(block)`:
    each block is read, then converted (quantized: qkv.generate.weights.convert_block) before the next is
    read, where the architecture's mapping only renames the file's tensors (llama, qwen2); otherwise it is
    not called (the caller converts the loaded model). `shipped`: there, each linear layer whose tensor is
    of a quantized block type (blocks.SHIPPED_TYPES) holds the file's blocks as they are (qkv.nn.quant's int4
    and int8g kinds), and so does the output head; an embedding table of such a type looks its rows up in its
    blocks (the head's, where tied); the rest is read dequantized to fp32."""
    path = Path(path)
    file, arch, hf, family, cfg = read_model_config(path)
    tokenizer = cached_tokenizer(file.metadata, str(path))  # first: its parsing's garbage is returned before
    check_vocabulary(tokenizer, cfg.vocab_size, path)  # the weights are read (qkv.heap.return_freed)
    with torch.device("meta"):  # no memory and no random initialisation: the file's tensors become the weights
        model = build_model(cfg)
    buffers = any(True for _ in model.buffers())
    streams = (convert is not None or shipped) and not buffers and hasattr(model, "blocks")
    readers = block_readers(file, arch, hf, family, cfg, path, model if shipped else None) if streams else None
    if readers is not None:
        stream_blocks(model, readers, str(path), convert, ship_embedding(model, readers) if shipped else set())
    elif shipped and not buffers and ship_whole(model, file, arch, hf, family, cfg, path):
        pass
    else:
        try:
            tensors = family.to_qkv(hf_tensors(file, arch, hf), cfg)
        except QkvError as exc:
            raise QkvError(f"{path}: {exc}") from None
        model = model_with(cfg, tensors, str(path))  # one fp32 copy of the weights in memory, not two
        del tensors
    file.release()
    return Run(path=path, config=run_config(cfg, tokenizer.vocab_size), model=model.to(device).eval(),
               tokenizer=tokenizer, chat=chat_of(file.metadata, tokenizer))


def block_readers(file: GgufFile, arch, hf: dict, family, cfg, path: Path,
                  model: nn.Module | None = None) -> dict[str, Callable[[], torch.Tensor | Shipped]] | None:
    """{qkv name: a function reading that tensor from the file} when the HF family's mapping only renames the
    file's tensors (found by running it on shape-only meta tensors); None when it makes tensors from several
    (gpt2's Q/K/V split), which are then read all at once. With `model`, the weights of its linear layers
    stored in a quantized block type read as their blocks (a Shipped, where their rows allow it)."""
    placeholders, sources = {}, {}
    try:
        for name in weights(file, arch):
            hf_name = hf_name_of(arch, name, hf)
            shape = tuple(int(n) for n in reversed(file.tensors[name].shape.tolist()))
            placeholders[hf_name] = torch.empty(shape, device="meta")
            sources[id(placeholders[hf_name])] = (name, hf_name)
        mapped = family.to_qkv(placeholders, cfg)
    except QkvError as exc:
        raise QkvError(f"{path}: {exc}") from None
    except (NotImplementedError, RuntimeError):  # the mapping looks at values: read everything
        return None
    readers = {}
    for qkv_name, tensor in mapped.items():
        if id(tensor) in sources:
            name, hf_name = sources[id(tensor)]
            readers[qkv_name] = functools.partial(read_tensor, file, arch, hf, name, hf_name)
            module_name = qkv_name.removesuffix(".weight")
            module = layer_at(model, module_name) if model is not None and qkv_name.endswith(".weight") else None
            if shippable(file.tensors[name], module, module_name):
                readers[qkv_name] = functools.partial(read_blocks, file, arch, hf, name, hf_name)
            if model is not None:
                readers[qkv_name].source = name
        elif tensor.device.type != "meta":  # made by the mapping without the file (qwen2's zero biases)
            readers[qkv_name] = functools.partial(lambda t: t, tensor)
        else:
            return None
    return readers


def stream_blocks(model: nn.Module, readers: dict[str, Callable[[], torch.Tensor]], origin: str,
                  convert: Callable[[nn.Module], None], made: set[str] = frozenset()) -> None:
    """Each block's tensors read, assigned and converted before the next block's are read; then the rest (the
    embedding, the final norm, the head; those in `made` are made already). Peak: the converted blocks and one
    block in fp32."""
    for i, block in enumerate(model.blocks):
        inside = functools.partial(under, f"blocks.{i}")
        part = {name: read() for name, read in readers.items() if inside(name)}
        layers = place_shipped(model, part)
        assign_model_tensors(model, part, origin, within=lambda name: inside(name) and name not in layers)
        del part
        if convert is not None:
            convert(block)
    def outside(name: str) -> bool:
        return not under("blocks", name)

    rest = {name: read() for name, read in readers.items() if outside(name)}
    layers = place_shipped(model, rest) | made
    assign_model_tensors(model, rest, origin, within=lambda name: outside(name) and name not in layers)


def ship_whole(model: nn.Module, file: GgufFile, arch, hf: dict, family, cfg, path: Path) -> bool:
    """Fill the meta `model` at once where the mapping does more than rename (Gemma's norms are 1 + w): the
    family's mapping run on the file's tensors, those of a quantized block type as shape-only placeholders;
    each that comes out as itself holds its blocks where it is a linear layer's weight and is read dequantized
    elsewhere (an embedding), the rest (norms) is the mapping's. False, with nothing changed, when a
    placeholder went into something else (gpt2's split Q/K/V): the caller then reads everything dequantized."""
    tensors, sources = {}, {}
    for name in weights(file, arch):
        hf_name = hf_name_of(arch, name, hf)
        tensor = file.tensors[name]
        if tensor.tensor_type.name in SHIPPED_TYPES:
            tensors[hf_name] = torch.empty(tuple(int(n) for n in reversed(tensor.shape.tolist())), device="meta")
            sources[id(tensors[hf_name])] = (name, hf_name)
        else:
            tensors[hf_name] = read_tensor(file, arch, hf, name, hf_name)
    try:
        mapped = family.to_qkv(tensors, cfg)
    except QkvError as exc:
        raise QkvError(f"{path}: {exc}") from None
    except (NotImplementedError, RuntimeError):
        return False
    readers = {}
    for qkv_name, tensor in mapped.items():
        if tensor.device.type != "meta":
            readers[qkv_name] = functools.partial(lambda t: t, tensor)
            continue
        if id(tensor) not in sources:
            return False
        readers[qkv_name] = functools.partial(read_tensor, file, arch, hf, *sources[id(tensor)])
        readers[qkv_name].source = sources[id(tensor)][0]
        module_name = qkv_name.removesuffix(".weight")
        module = layer_at(model, module_name) if qkv_name.endswith(".weight") else None
        if shippable(file.tensors[readers[qkv_name].source], module, module_name):
            readers[qkv_name] = functools.partial(read_blocks, file, arch, hf, *sources[id(tensor)])
    made = ship_embedding(model, readers)
    part = {name: read() for name, read in readers.items()}
    layers = place_shipped(model, part) | made
    assign_model_tensors(model, part, str(path), within=lambda name: name not in layers)
    return True


def read_blocks(file: GgufFile, arch, hf: dict, name: str, hf_name: str) -> torch.Tensor | Shipped:
    """The tensor as its blocks (blocks.read_shipped), or dequantized where its rows are not simply reordered."""
    return read_shipped(file, arch, hf, name, hf_name) or read_tensor(file, arch, hf, name, hf_name)


def layer_at(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def place_shipped(model: nn.Module, part: dict) -> set[str]:
    """Each Shipped weight of `part` made the layer it belongs to (its bias taken from `part`), removed from
    `part`; the names of the layers so made."""
    made = set()
    for name in [name for name, value in part.items() if isinstance(value, Shipped)]:
        layer = name.removesuffix(".weight")
        bias = part.pop(f"{layer}.bias", None)
        parent, _, attribute = layer.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, part.pop(name).layer(bias))
        made.add(layer)
    return made


def ship_embedding(model: nn.Module, readers: dict) -> set[str]:
    """An embedding table stored in a quantized block type, before anything is read: looked up in its blocks
    (qkv.nn.embedding.QuantEmbedding), never held dequantized. Tied to the output head (SmolLM2's and Gemma 3's
    Q8_0 tables) the head holds the blocks as shipped and the table reads them; untied (Llama 3.1 8B's Q4_K table
    beside a Q6_K head), the table holds its own. Their readers are taken out of `readers`; the names of the
    modules so made."""
    head, embedding = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
    read = readers.get("tok_emb.weight")
    if type(embedding) is not nn.Embedding or read is None or read.func is not read_tensor:
        return set()
    tensor = read.args[0].tensors[read.source]
    tied = type(head) is nn.Linear and head.weight is embedding.weight
    if not (shippable(tensor, head, "lm_head") if tied else
            tensor.tensor_type.name in SHIPPED_TYPES and len(tensor.shape) == 2):
        return set()
    blocks = read_blocks(*read.args)
    if not isinstance(blocks, Shipped):
        return set()
    del readers["tok_emb.weight"]
    if not tied:
        model.tok_emb = QuantEmbedding(blocks.layer(None))
        return {"tok_emb"}
    model.lm_head = blocks.layer(readers.pop("lm_head.bias")() if head.bias is not None else None)
    model.tok_emb = QuantEmbedding(model.lm_head)
    return {"lm_head", "tok_emb"}


def under(prefix: str, name: str) -> bool:
    """`name` is the module `prefix` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def config(path: str | Path) -> RunConfig:
    """The Run's config alone, from the file's metadata and tensor shapes: no weight is read."""
    path = Path(path)
    file, _, _, _, cfg = read_model_config(path)
    tokenizer = cached_tokenizer(file.metadata, str(path))
    check_vocabulary(tokenizer, cfg.vocab_size, path)
    return run_config(cfg, tokenizer.vocab_size)


def read_model_config(path: Path):
    """(the open file, its architecture's entry, the HF config it stands for, the HF family, qkv's config)."""
    file = GgufFile.open(path)
    if file.get("general.type") == "adapter":
        raise QkvError(f"{path}: a LoRA adapter (general.type = adapter), not a model: give its base model, and "
                       "this file with --adapter")
    name = file.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise QkvError(f"{path}: GGUF architecture {name!r} is not supported; supported: "
                       f"{', '.join(GGUF_ARCHS.names())}")
    arch = GGUF_ARCHS.get(name)
    shapes = {tensor: tuple(int(n) for n in reversed(t.shape.tolist())) for tensor, t in file.tensors.items()}
    if "token_embd.weight" not in shapes:
        raise QkvError(f"{path}: has no token_embd.weight tensor")
    try:
        settings = {name: file.tensor(name) for name in arch.settings if name in file.tensors}  # rope_freqs
        hf = arch.hf_config({**file.metadata, **settings}, shapes)
        family = HF_FAMILIES.get(hf["model_type"])
        cfg = check_model(family.config(hf, hf["architectures"][0]))
    except QkvError as exc:
        raise QkvError(f"{path}: {exc}") from None
    return file, arch, hf, family, cfg


def hf_tensors(file: GgufFile, arch, hf: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to fp32, under its Hugging Face name."""
    out = {}
    for name in weights(file, arch):
        hf_name = hf_name_of(arch, name, hf)
        out[hf_name] = read_tensor(file, arch, hf, name, hf_name)
    return out


def weights(file: GgufFile, arch) -> list[str]:
    """The file's tensors that are weights (not settings its architecture reads into the config)."""
    return [name for name in file.names if name not in arch.settings]


def hf_name_of(arch, name: str, hf: dict) -> str:
    hf_name = arch.hf_name(name)
    if hf_name is None:
        raise QkvError(f"tensor {name!r} has no place in a {hf['model_type']} model")
    return hf_name


def read_tensor(file: GgufFile, arch, hf: dict, name: str, hf_name: str) -> torch.Tensor:
    """One tensor of the file, dequantized to fp32, as the HF checkpoint holds it (llama.cpp's Q/K row
    permutation undone)."""
    return torch.from_numpy(arch.to_hf(hf_name, file.tensor(name), hf))


def chat_of(meta: dict, tokenizer) -> Chat:
    tokens = meta.get("tokenizer.ggml.tokens", [])
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise QkvError("tokenizer.chat_template must be a string")
    stops = [meta.get(f"tokenizer.ggml.{which}_token_id") for which in ("eos", "eot", "eom")]
    stop_ids = tuple(dict.fromkeys(i for i in stops if isinstance(i, int) and 0 <= i < tokenizer.vocab_size))
    return Chat(template=template, bos_token=token_of(meta, "bos", tokens) or "", stop_ids=stop_ids)
