"""Encoder-decoder (note 000 §7, §8, §18; SPEC A7): causality, padding, cross-attention, the cached decode
== teacher forcing, shared embeddings, and Hugging Face BART as a numeric oracle."""

import pytest
import torch

from qkv import presets
from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.nn import registries

V = 40


def config(**overrides) -> ModelConfig:
    base = dict(arch="encoder-decoder", vocab_size=V, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def model(**overrides) -> EncoderDecoder:
    return build_model(config(**overrides)).double().eval()


def ids(*shape) -> torch.Tensor:
    return torch.randint(0, V, shape)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_target_t_sees_targets_up_to_t_only(placement):
    m, src, tgt = model(norm_placement=placement), ids(2, 7), ids(2, 6)
    changed = tgt.clone()
    changed[:, 3] = (changed[:, 3] + 1) % V
    a, b = m(src, tgt), m(src, changed)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-12)
    assert not torch.allclose(a[:, 3:], b[:, 3:], atol=1e-6)


def test_every_target_sees_every_source_token():
    """Cross-attention is not causal: changing the LAST source token changes the FIRST target's logits."""
    m, src, tgt = model(), ids(2, 7), ids(2, 4)
    changed = src.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    assert not torch.allclose(m(src, tgt)[:, 0], m(changed, tgt)[:, 0], atol=1e-6)


def test_gradient_reaches_every_encoder_parameter():
    m = build_model(config(tie_embeddings=False))
    m(ids(2, 7), ids(2, 5)).sum().backward()
    encoder = dict(m.encoder.named_parameters())
    assert encoder and all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.values())


def test_cross_attention_reads_keys_and_values_from_the_encoder_output():
    """Q = Y W_Q, K = H_enc W_K, V = H_enc W_V (note 000 §8.4): the cross-attention's k_proj and v_proj
    receive exactly encode(src)."""
    m, src, tgt = model(), ids(2, 7), ids(2, 5)
    seen = []
    hook = m.blocks[1].cross_attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    m(src, tgt)
    hook.remove()
    assert torch.equal(seen[0], m.encode(src))


@pytest.mark.parametrize("side", ["right", "left"])
def test_source_padding_changes_nothing(side):
    m, src, tgt = model(positional="learned"), ids(2, 5), ids(2, 4)
    pad = ids(2, 3)  # arbitrary ids under the padding
    padded = torch.cat((src, pad), 1) if side == "right" else torch.cat((pad, src), 1)
    mask = torch.ones(2, 8, dtype=torch.long)
    if side == "right":
        mask[:, 5:] = 0
    else:
        mask[:, :3] = 0
    torch.testing.assert_close(m(padded, tgt, mask), m(src, tgt), atol=1e-10, rtol=0)


def test_target_right_padding_changes_no_real_position():
    m, src, tgt = model(), ids(2, 5), ids(2, 4)
    padded = torch.cat((tgt, ids(2, 3)), 1)
    tgt_mask = torch.cat((torch.ones(2, 4), torch.zeros(2, 3)), 1).long()
    torch.testing.assert_close(m(src, padded, tgt_mask=tgt_mask)[:, :4], m(src, tgt), atol=1e-10, rtol=0)


@pytest.mark.parametrize("overrides", [{}, dict(norm_placement="post", positional="sinusoidal"),
                                       dict(positional="rope", n_kv_heads=2, norm="rmsnorm", bias=False),
                                       *(dict(positional=name) for name in registries.get("positional").names()
                                         if name not in ("learned", "sinusoidal", "rope"))])
def test_cached_incremental_decoding_equals_teacher_forcing(overrides):
    """Prefill 2 target tokens, then one per call; the cross-attention K/V come from the cache."""
    m, src, tgt = model(**overrides), ids(3, 6), ids(3, 7)
    src_mask = torch.ones(3, 6, dtype=torch.long)
    src_mask[1, 4:] = 0
    full = m(src, tgt, src_mask)
    cache = m.new_cache(3, 8)
    memory = m.encode(src, src_mask)
    steps = [m(None, tgt[:, :2], src_mask, memory=memory, cache=cache)]
    steps += [m(None, tgt[:, t:t + 1], cache=cache) for t in range(2, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)


def test_cross_attention_projects_the_encoder_output_once_per_layer():
    m, src, tgt = model(), ids(2, 6), ids(2, 4)
    lengths = []
    for block in m.blocks:
        block.cross_attn.k_proj.register_forward_hook(lambda mod, args, out: lengths.append(args[0].shape[1]))
    cache = m.new_cache(2, 4)
    for t in range(4):
        m(src if t == 0 else None, tgt[:, t:t + 1], cache=cache)
    assert lengths == [6, 6] + [0, 0] * 3  # the first call projects S = 6 rows per layer; later calls none


def test_cache_reorder_continues_the_selected_rows():
    """Beam search keeps and duplicates rows: decoding on after reorder == decoding those rows from scratch."""
    m, src, tgt = model(), ids(2, 6), ids(2, 5)
    src_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    cache = m.new_cache(2, 5)
    m(src, tgt[:, :3], src_mask, cache=cache)
    rows = torch.tensor([1, 1, 0])
    cache.reorder(rows)
    got = m(None, tgt[rows, 3:], cache=cache)
    torch.testing.assert_close(got, m(src[rows], tgt[rows], src_mask[rows])[:, 3:], atol=1e-10, rtol=0)


def test_tied_embeddings_share_one_matrix_for_source_target_and_output():
    """Vaswani et al. §3.4: one W_E for both embeddings and the pre-softmax projection."""
    tied, untied = build_model(config()), build_model(config(tie_embeddings=False))
    assert tied.encoder.tok_emb is tied.tok_emb and tied.lm_head.weight is tied.tok_emb.weight
    assert list(tied.state_dict())[0] == "tok_emb.weight"
    assert len({id(untied.encoder.tok_emb.weight), id(untied.tok_emb.weight), id(untied.lm_head.weight)}) == 3
    V, D = tied.tok_emb.weight.shape
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 2 * V * D


def test_embed_scale_multiplies_token_embeddings_by_sqrt_d():
    """Vaswani et al. §3.4: E[x] * sqrt(D) == the same model with a table sqrt(D) times larger (D = 16)."""
    scaled, plain = model(embed_scale=True), model()
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        plain.tok_emb.weight.mul_(4.0)  # also the encoder's (shared) table
    src = ids(2, 5)
    torch.testing.assert_close(scaled.encode(src), plain.encode(src), atol=1e-12, rtol=0)


def test_vaswani_base_parameter_count_closed_form():
    """Shared W_E (V D); encoder layers 4(D^2 + D) + 2 D F + F + D + 2(2D); decoder layers add a second
    attention and norm. 63.1M with a 37000-token vocabulary (the paper's Table 3 says 65M)."""
    cfg = presets.get("vaswani-base").model
    V, D, F, L = cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_layers
    attention, ffn, norm = 4 * (D * D + D), 2 * D * F + F + D, 2 * D
    expected = V * D + L * (attention + ffn + 2 * norm) + L * (2 * attention + ffn + 3 * norm)
    with torch.device("meta"):
        assert sum(p.numel() for p in build_model(cfg).parameters()) == expected == 63_082_496


def test_t5_small_has_the_parameters_of_hugging_face_t5():
    """T5-small in transformers (random init, meta device): 60,506,624 parameters, with 2 x 32 x 8 relative
    position buckets (one table per stack); qkv's decoder stack takes the causal twin of the "t5" bias."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(transformers.T5Config())  # the t5-small defaults
        ours = build_model(presets.get("t5-small").model)
    assert sum(p.numel() for p in ours.parameters()) == hf.num_parameters() == 60_506_624
    assert ours.positional.bidirectional is False and ours.encoder.positional.bidirectional is True


# ---- Hugging Face BART as the oracle: Post-LN, learned positions, embedding LayerNorm, GELU ---------------------
def bart_pair():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, activation_function="gelu",
                                     scale_embedding=False, pad_token_id=1)
    hf = transformers.BartForConditionalGeneration(hf_cfg).double().eval()
    ours = model(norm_placement="post", activation="gelu", embed_norm=True, positional="learned")
    state = {}
    for ours_prefix, hf_prefix, layers in (("encoder.", "model.encoder.", 2), ("", "model.decoder.", 2)):
        hf_stack = dict(hf.state_dict())
        state[f"{ours_prefix}positional.weight"] = hf_stack[f"{hf_prefix}embed_positions.weight"][2:34]  # offset 2
        for part in ("weight", "bias"):
            state[f"{ours_prefix}embed_norm.{part}"] = hf_stack[f"{hf_prefix}layernorm_embedding.{part}"]
        for i in range(layers):
            names = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
                     "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.out_proj",
                     "attn_norm": "self_attn_layer_norm", "ffn.up_proj": "fc1", "ffn.down_proj": "fc2",
                     "ffn_norm": "final_layer_norm", "cross_attn.q_proj": "encoder_attn.q_proj",
                     "cross_attn.k_proj": "encoder_attn.k_proj", "cross_attn.v_proj": "encoder_attn.v_proj",
                     "cross_attn.o_proj": "encoder_attn.out_proj", "cross_norm": "encoder_attn_layer_norm"}
            for mine, theirs in names.items():
                for part in ("weight", "bias"):
                    key = f"{hf_prefix}layers.{i}.{theirs}.{part}"
                    if key in hf_stack:
                        state[f"{ours_prefix}blocks.{i}.{mine}.{part}"] = hf_stack[key]
    state["tok_emb.weight"] = hf.state_dict()["model.shared.weight"]
    missing = set(dict(ours.named_parameters())) - set(state)
    assert not missing, missing
    ours.load_state_dict(state, strict=False)
    return hf, ours


def test_logits_match_hugging_face_bart():
    hf, ours = bart_pair()
    src, tgt = torch.randint(2, V, (2, 7)), torch.randint(2, V, (2, 5))
    src_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(ours(src, tgt, src_mask), expected, atol=1e-10, rtol=1e-10)
