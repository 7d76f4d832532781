"""How `generate` feeds each model family: one registry entry per family, keyed by the model's class.

A family turns the caller's `input_ids` / `attention_mask` into a `Prompt`: the ids returned in front of
the new tokens, the ids the decoder is prefilled with, the context clamp, and a factory for a cached
decoder (prefill / step / reorder) that the strategies drive without knowing the family:

    decoder:          input_ids (B, T) is the prompt (LEFT-padded by attention_mask); the decoder continues it;
                      the output starts with the whole input_ids.
    encoder-decoder:  input_ids (B, S) is the source, attention_mask (B, S) its padding (any side: the encoder
                      is bidirectional and positions count real tokens only, so right padding, as
                      qkv.data.seq2seq makes it, and left padding give the same result). The encoder runs
                      once; every decoder layer projects the encoder output to its cross-attention K/V once
                      (the first cached call) and reads them from the cache afterwards. The decoder starts
                      from `decoder_start` (required: qkv's seq2seq objective feeds [BOS] + target with
                      BOS = the tokenizer's eos_id, so pass `decoder_start=tokenizer.eos_id`); the output is
                      (B, 1 + new): decoder_start, then the new tokens (as transformers' generate).

Context limit (prompt + new <= model.max_seq_len, module docstring of qkv.generate.decode) is lifted when
the model's cache rolls (a local kernel: qkv.nn.cache) AND its positional encoding only ever compares
positions (`shift_invariant` in its class: none, RoPE, ALiBi, Shaw, Transformer-XL, T5): every query then sees at most w
earlier keys at distances it met in training, so generation may run past max_seq_len with O(w) memory.
Absolute encodings keep the limit: a learned table has no row max_seq_len, and sinusoidal positions past
it were never trained on. An encoder-decoder's source is always cut to its first max_seq_len tokens
(as qkv.data.seq2seq cuts sources), with a `PromptTruncatedWarning`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.generate.compiled import next_logits, prompt_logits
from qkv.models.build import ARCHITECTURES, architecture_of
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.nn.cache import rolling_window
from qkv.registry import Registry


class PromptTruncatedWarning(UserWarning):
    """The prompt (or source) or max_new_tokens was clamped to fit model.max_seq_len."""


class Decoder(Protocol):
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor: ...  # (B, T) -> (B, V)
    def step(self, tokens: Tensor) -> Tensor: ...  # (B,) -> (B, V)
    def reorder(self, rows: Tensor) -> None: ...


class CachedDecoder:
    """Feeds a decoder LM its prompt once, then one token per row per call, through a KV cache."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(batch, max_len, rolling=True)  # O(w) for a local kernel

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """(B, T) prompt -> (B, V) logits for the token after it (left padding: the last column)."""
        return prompt_logits(self.model, input_ids, self.cache, attention_mask)  # (compiled where enabled)

    def step(self, tokens: Tensor) -> Tensor:
        """(B,) newest tokens -> (B, V) logits for the next ones (by the compiled step where it is enabled
        and applies: qkv.generate.compiled)."""
        return next_logits(self.model, tokens, self.cache)

    def reorder(self, rows: Tensor) -> None:
        """Continue from cache rows `rows` (beam search: select and duplicate beams)."""
        self.cache.reorder(rows)


class Seq2SeqDecoder(CachedDecoder):
    """Runs the encoder once, then feeds the decoder its start tokens and one token per row per call."""

    def __init__(self, model: EncoderDecoder, src_ids: Tensor, src_mask: Tensor | None, max_len: int):
        super().__init__(model, src_ids.shape[0], max_len)
        self.src_mask = src_mask
        self.memory = model.encode(src_ids, src_mask)  # H_enc (B, S, D)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        logits = self.model.decode(input_ids, self.memory, self.src_mask, attention_mask, self.cache)[:, -1]
        self.memory = None  # the cache now holds every layer's cross-attention K/V
        return logits  # (B, V)

    def step(self, tokens: Tensor) -> Tensor:
        return self.model.decode(tokens[:, None], None, cache=self.cache)[:, -1]  # (B, V)


@dataclass
class Prompt:
    prefix: Tensor  # (B, P) returned in front of the new tokens
    ids: Tensor  # (B, T) the decoder's prefill (the prefix, possibly cut to fit the context)
    mask: Tensor | None  # (B, T) left padding of ids, or None
    max_new: int  # max_new_tokens after the context clamp
    open: Callable[[int], Decoder]  # max_len -> a fresh cached decoder for the batch (runs the encoder)


PromptFeeder = Callable[[nn.Module, Tensor, "Tensor | None", int, "int | None"], Prompt]
PROMPTS: Registry[PromptFeeder] = Registry("prompt")  # the `prompt` of a model's qkv.models.build.Architecture


def prompt_feeder(model: nn.Module) -> PromptFeeder:
    """How `generate` feeds `model` its prompt: its architecture's entry says which PROMPTS entry."""
    kind = architecture_of(model).prompt
    if kind is None:
        writers = [cls.__name__ for name in ARCHITECTURES.names() if ARCHITECTURES.get(name).prompt
                   for cls in ARCHITECTURES.get(name).classes]
        raise QkvError(f"generate supports {', '.join(writers)} models; got a {type(model).__name__}")
    return PROMPTS.get(kind)


def context_limit(model: nn.Module) -> int | None:
    """model.max_seq_len, or None where generation may run past it (module docstring)."""
    attn = model.blocks[0].attn
    rolls = rolling_window(attn.kernel_name, attn.window) > 0
    return None if rolls and model.positional.shift_invariant else model.max_seq_len


@PROMPTS.register("continue")
def decoder_prompt(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
                   decoder_start: int | None) -> Prompt:
    if decoder_start is not None:
        raise QkvError("decoder_start is for encoder-decoder models; a decoder-only model continues input_ids")
    ids, mask = as_batch(model, input_ids, attention_mask, check_left_padded)
    model_ids, model_mask, max_new = fit_context(ids, mask, max_new_tokens, context_limit(model))
    return Prompt(ids, model_ids, model_mask, max_new, lambda max_len: CachedDecoder(model, ids.shape[0], max_len))


@PROMPTS.register("source")
def seq2seq_prompt(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
                   decoder_start: int | None) -> Prompt:
    if decoder_start is None:
        raise QkvError("an encoder-decoder model needs decoder_start=<token id> (qkv's seq2seq training starts "
                       "every target with BOS = the tokenizer's eos_id)")
    src, src_mask = as_batch(model, input_ids, attention_mask, check_source_mask)
    if src.shape[1] > model.max_seq_len:
        warnings.warn(f"model.max_seq_len={model.max_seq_len}: source of {src.shape[1]} tokens cut to its first "
                      f"{model.max_seq_len}", PromptTruncatedWarning, stacklevel=4)
        src = src[:, :model.max_seq_len]
        src_mask = None if src_mask is None else check_source_mask(src_mask[:, :model.max_seq_len])
    start = torch.full((src.shape[0], 1), decoder_start, dtype=torch.long, device=src.device)  # (B, 1)
    _, _, max_new = fit_context(start, None, max_new_tokens, context_limit(model))
    return Prompt(start, start, None, max_new, lambda max_len: Seq2SeqDecoder(model, src, src_mask, max_len))


def as_batch(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
             check_mask: Callable[[Tensor], Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """(T,) or (B, T) ids and optional mask -> (B, T) long ids on the model's device, mask or None."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, device=device).long()
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise QkvError(f"input_ids must be (B, T) or (T,) with T >= 1, got shape {tuple(ids.shape)}")
    if attention_mask is None:
        return ids, None
    mask = torch.as_tensor(attention_mask, device=device)
    mask = mask[None] if mask.dim() == 1 else mask
    if mask.shape != ids.shape:
        raise QkvError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(ids.shape)}")
    return ids, check_mask(mask)


def check_source_mask(mask: Tensor) -> Tensor | None:
    """Validate a (B, S) 0/1 source mask with a token in every row; None when it masks nothing."""
    if mask.dim() != 2 or not bool(((mask == 0) | (mask == 1)).all()) or not bool(mask.any(-1).all()):
        raise QkvError("attention_mask (the source padding) must be a (B, S) tensor of 0 (padding) and 1 "
                       "(token) with at least one token in every row")
    return None if bool(mask.all()) else mask.long()


def check_left_padded(mask: Tensor) -> Tensor | None:
    """Validate a (B, T) 0/1 mask as left padding; None when it masks nothing."""
    if mask.dim() != 2 or not bool(((mask == 0) | (mask == 1)).all()):
        raise QkvError("attention_mask must be a (B, T) tensor of 0 (padding) and 1 (token)")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool(mask[:, -1].all()):
        raise QkvError("attention_mask must be LEFT padding (0s then 1s, the last column 1 in every row); "
                       "use qkv.generate.pad_left")
    return None if bool(mask.all()) else mask.long()


def fit_context(ids: Tensor, mask: Tensor | None, max_new_tokens: int,
                max_seq_len: int | None) -> tuple[Tensor, Tensor | None, int]:
    """Clamp so that prompt + new <= max_seq_len (None: no limit), warning once if anything real is cut."""
    if max_seq_len is None:
        return ids, mask, max_new_tokens
    max_new = min(max_new_tokens, max_seq_len - 1)
    keep = max_seq_len - max_new  # prompt columns that fit, at least 1
    notes = []
    if max_new < max_new_tokens:
        notes.append(f"max_new_tokens={max_new_tokens} reduced to {max_new}")
    cut = ids.shape[1] - keep
    if cut > 0:
        if mask is None or bool(mask[:, :cut].any()):
            notes.append(f"prompt of {ids.shape[1]} tokens cut to its last {keep}")
        ids, mask = ids[:, cut:], (None if mask is None else check_left_padded(mask[:, cut:]))
    if notes:
        warnings.warn(f"model.max_seq_len={max_seq_len}: " + "; ".join(notes), PromptTruncatedWarning,
                      stacklevel=4)
    return ids, mask, max_new
