"""Presets: every one is a valid config, and the published models have their published sizes."""
import dataclasses

import pytest
import torch

from qkv import presets
from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.models import build_model


def n_params(name: str) -> int:
    with torch.device("meta"):  # sizes only: no memory, no init cost
        return sum(p.numel() for p in build_model(presets.get(name).model).parameters())


def test_names_and_descriptions():
    assert {"tiny", "shakespeare", "gpt2-124m", "llama-small", "gpt3-175b"} <= set(presets.PRESETS.names())
    for name in presets.PRESETS.names():
        assert presets.describe(name) and "\n" not in presets.describe(name)
    with pytest.raises(QkvError, match="unknown preset 'gpt5'; choose from: .*tiny"):
        presets.get("gpt5")


@pytest.mark.parametrize("name", presets.PRESETS.names())
def test_every_preset_validates_and_round_trips_through_json(name):
    cfg = presets.get(name).validate()
    assert cfg.train.seq_len <= cfg.model.max_seq_len
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert presets.get(name) is not presets.get(name)  # a fresh config each call


def test_gpt2_small_has_124m_parameters():
    """GPT-2 small as Hugging Face counts it: tied head, learned positions, biases."""
    assert n_params("gpt2-124m") == 124_439_808


def test_gpt3_175b_parameter_count_closed_form():
    """12 L d^2 (attention 4 d^2 + FFN 8 d^2) + 13 L d (biases, norms) + (V + T) d + 2 d (final norm):
    174.6e9, the "175B" of Brown et al. (2020) (SPEC claim 23)."""
    cfg = presets.get("gpt3-175b").model
    L, d, V, T = cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.max_seq_len
    expected = 12 * L * d * d + 13 * L * d + (V + T) * d + 2 * d
    assert n_params("gpt3-175b") == expected == 174_604_259_328


def test_llama_small_parameter_count_closed_form():
    """GQA (K and V with n_kv_heads of n_heads), SwiGLU (3 d F), RMSNorm gains, no biases, untied head."""
    cfg = presets.get("llama-small").model
    L, d, F, V = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    kv = d * cfg.n_kv_heads // cfg.n_heads
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * F + 2 * d
    assert n_params("llama-small") == L * per_layer + 2 * V * d + d


def test_tiny_is_tiny_and_trains_briefly():
    cfg = presets.get("tiny")
    model = dataclasses.replace(cfg.model, vocab_size=280)
    with torch.device("meta"):
        count = sum(p.numel() for p in build_model(model).parameters())
    d, L, F, T = model.d_model, model.n_layers, model.d_ff, model.max_seq_len
    assert count == L * (4 * d * d + 4 * d + 2 * d * F + F + d + 4 * d) + (280 + T) * d + 2 * d
    assert cfg.train.max_steps * cfg.train.batch_size * cfg.train.seq_len <= 10_000
