"""Helpers for the GGUF tests: tiny GGUF files written with the `gguf` package's own writer (llama.cpp's
layout: Q and K rows permuted as its converter permutes them), from random transformers models, with a small
byte-level BPE trained here as their tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qkv.data.tokenizer import Tokenizer  # noqa: E402

TEXT = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"] * 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def small_tokenizer() -> tuple[list[str], list[str], list[int]]:
    """(tokens in id order, merges, token types): a byte-level BPE with <|endoftext|>, <|im_start|>, <|im_end|>."""
    tok = Tokenizer.train(TEXT, 300)
    tok.add_specials(["<|im_start|>", "<|im_end|>"])
    raw = json.loads(tok.to_str())
    vocab = {**raw["model"]["vocab"], **{t["content"]: t["id"] for t in raw["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in raw["model"]["merges"]]
    specials = {t["content"] for t in raw["added_tokens"]}
    return tokens, merges, [3 if t in specials else 1 for t in tokens]


def sentencepiece_tokenizer() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) laid out as Llama 2's: <unk>, <s>, </s>, the 256 <0xNN> byte tokens, then
    SentencePiece-style BPE pieces ("▁" for a space, learned here) ranked by score; no merges (a SentencePiece
    GGUF has none: they follow from the scores)."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(TEXT, vocab_size=400, min_frequency=1, show_progress=False)
    learned = sorted(learner.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [piece for piece, _ in learned if piece not in tokens]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return tokens, scores, types


def add_byte_level(writer) -> None:
    """small_tokenizer() into a GGUF writer: gpt2 model, its merges, <|im_start|> as BOS, <|im_end|> as EOS."""
    tokens, merges, types = small_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))


def ggml_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q / K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LLAMA_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{LLAMA_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_llama(path: Path, *, qtype: str = "F32", tied: bool = False, seed: int = 0, layers: int = 2,
                kv_heads: int = 2, template: str | None = TEMPLATE, edit=None, width: int = 64, ffn: int | None = None,
                raw=None, vocab: int | None = None, tokenizer: bool | str = True, arch: str = "llama") -> Path:
    """A random llama (d `width`, 4 heads, `kv_heads` KV heads, FFN `ffn` or 1.5 d) as a GGUF file; matrices stored as
    `qtype`, or as `raw(name, matrix) -> (bytes, type)` gives them. `edit(writer)` may add or change metadata
    before the file is written. `vocab`: embedding rows other than the tokenizer's size; `tokenizer`: False
    writes none, "sentencepiece" Llama 2's kind. `arch` "qwen2": a Qwen2 (Q/K/V biases), whose rows llama.cpp
    does not permute."""
    tokens, merges, types = small_tokenizer()
    if tokenizer == "sentencepiece":
        tokens, scores, types = sentencepiece_tokenizer()
    torch.manual_seed(seed)
    ffn = ffn or width * 3 // 2
    config_class = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    config = config_class(vocab_size=vocab or len(tokens), hidden_size=width, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                                      max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    if arch == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(width // 4)
    if tokenizer == "sentencepiece":
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    elif tokenizer:
        add_byte_level(writer)
    if template is not None:
        writer.add_chat_template(template)
    if edit is not None:
        edit(writer)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        w = tensor.detach().numpy().astype(np.float32)
        if name.endswith("q_proj.weight") and arch == "llama":
            w = ggml_rows(w, 4)
        elif name.endswith("k_proj.weight") and arch == "llama":
            w = ggml_rows(w, kv_heads)
        kind = gguf.GGMLQuantizationType[qtype] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(w, kind) if kind != gguf.GGMLQuantizationType.F32 else w
        if raw is not None and w.ndim == 2:
            data, kind = raw(gguf_name(name), w)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own GGUF loader (from_pretrained(dir, gguf_file=...)), its logits for ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


GPT2_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
GPT2_TOP = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
            "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
            "lm_head.weight": "output.weight"}


def write_gpt2(path: Path, *, qtype: str = "F32", seed: int = 0, tied: bool = True) -> Path:
    """A random GPT-2 (d 64, 4 heads, 2 layers) as llama.cpp's converter writes one: Conv1D weights (in, out)
    stored transposed, (out, in)."""
    tokens, merges, types = small_tokenizer()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=len(tokens), n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                     tie_word_embeddings=tied)
    model = transformers.GPT2LMHeadModel(config).float()
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(2)
    writer.add_context_length(1024)  # transformers' GGUF loader keeps GPT-2's 1,024 positions whatever the file says
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    for name, tensor in model.state_dict().items():
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias") or (tied and name == "lm_head.weight"):
            continue
        w = tensor.detach().numpy().astype(np.float32)
        if name in GPT2_TOP:
            target = GPT2_TOP[name]
        else:
            _, _, layer, *rest = name.split(".")
            target = f"blk.{layer}.{GPT2_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
        if w.ndim == 2 and target.startswith("blk."):
            w = np.ascontiguousarray(w.T)  # Conv1D (in, out) -> (out, in)
        kind = gguf.GGMLQuantizationType[qtype] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(target, gguf.quants.quantize(w, kind) if kind != gguf.GGMLQuantizationType.F32 else w,
                          raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def finish(writer, path):
    """Write a GGUFWriter's header, metadata and tensors to its file and close it; the path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
