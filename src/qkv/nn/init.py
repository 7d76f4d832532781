"""Weight initialisation schemes (note 000 LLM §6.1; the W^Q/W^K/W^V part on Xavier and He init).

Every scheme has the signature `(model, *, std, n_layers)` and initialises in place.
"""
from __future__ import annotations

import math
from typing import Callable

from torch import nn

from qkv.nn.positional import Learned
from qkv.registry import Registry

INITS: Registry[Callable[..., None]] = Registry("init")
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")  # write into the residual stream


def _linears_and_embeddings(model: nn.Module):
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, Learned)) and id(module.weight) not in seen:
            seen.add(id(module.weight))  # a tied W_out = W_E is initialised once, as its first owner, W_E
            yield name, module


def _zero_biases(model: nn.Module) -> None:
    for _, module in _linears_and_embeddings(model):
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


@INITS.register("gpt2")
def gpt2_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """N(0, std) everywhere; residual projections N(0, std / sqrt(2L)) so the residual stream's
    variance stays O(1) over the 2L additions (GPT-2 paper, §2.3)."""
    for name, module in _linears_and_embeddings(model):
        scale = 1 / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else 1.0
        nn.init.normal_(module.weight, mean=0.0, std=std * scale)
    _zero_biases(model)


@INITS.register("zero_out")
def zero_out_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """GPT-2's N(0, std), with the residual projections (o_proj, down_proj) zero: every block starts as the
    identity and the stream is the embedding alone (modded-nanogpt; Zhang et al. 2019, Fixup's zero branch)."""
    gpt2_init(model, std=std, n_layers=n_layers)
    for name, module in _linears_and_embeddings(model):
        if name.endswith(RESIDUAL_PROJECTIONS):
            nn.init.zeros_(module.weight)


@INITS.register("xavier")
def xavier_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """Xavier/Glorot uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)); embeddings N(0, std)."""
    for _, module in _linears_and_embeddings(model):
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
        else:
            nn.init.normal_(module.weight, mean=0.0, std=std)
    _zero_biases(model)


@INITS.register("kaiming")
def kaiming_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """He/Kaiming normal: N(0, 2 / fan_in) for ReLU layers; embeddings N(0, std)."""
    for _, module in _linears_and_embeddings(model):
        if isinstance(module, nn.Linear):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        else:
            nn.init.normal_(module.weight, mean=0.0, std=std)
    _zero_biases(model)


ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")


def small_std(d_model: int) -> float:
    """sqrt(2 / (5 D)): Nguyen & Salazar 2019's SmallInit (GPT-NeoX's small_init), sqrt(2/5) of Xavier's
    std for a square D x D matrix."""
    return math.sqrt(2 / (5 * d_model))


def _note_scheme(model: nn.Module, *, std: float, residual_scale: float) -> None:
    """Note 000 LLM §6.1: W^Q, W^K, W^V small std; W^O (and every other linear) Xavier uniform; embeddings
    N(0, std). `residual_scale` multiplies the projections that write into the residual stream."""
    for name, module in _linears_and_embeddings(model):
        if not isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif name.endswith(ATTENTION_INPUTS):
            nn.init.normal_(module.weight, mean=0.0, std=small_std(module.weight.shape[1]))
        else:
            nn.init.xavier_uniform_(module.weight)
            if name.endswith(RESIDUAL_PROJECTIONS):
                module.weight.data.mul_(residual_scale)
    _zero_biases(model)


@INITS.register("small")
def small_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """Note 000 LLM §6.1 "注意力投影初始化": W^Q, W^K, W^V with a smaller std, N(0, sqrt(2 / (5 D)))
    (the note gives no number: SmallInit's), W^O Xavier uniform; the FFN Xavier uniform too."""
    _note_scheme(model, std=std, residual_scale=1.0)


@INITS.register("scaled")
def scaled_init(model: nn.Module, *, std: float, n_layers: int) -> None:
    """"small" plus scaled residual init: W^O and W_2 (down_proj) scaled by 1 / sqrt(2L), the GPT-2 §2.3 rule,
    so the 2L residual additions keep the stream's variance O(1) at init."""
    _note_scheme(model, std=std, residual_scale=1 / math.sqrt(2 * n_layers))
