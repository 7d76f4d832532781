import copy
import dataclasses
import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.kernels import KERNELS
from qkv.nn.positional import POSITIONALS

POSITIONAL_NAMES = POSITIONALS.names()
KERNEL_NAMES = KERNELS.names()
# Kernels that compute exact softmax attention, tested against the formula; the sparse and linear kernels
# (local, dilated, random, linear) compute other functions and have their own oracles. A new exact
# kernel adds its name here. Properties every kernel must keep (causality, cache) use KERNELS.names().
EXACT_KERNELS = [name for name in ("naive", "sdpa", "flash") if name in KERNELS]


def model_for(tiny_cfg: ModelConfig, **changes):
    torch.manual_seed(1)
    return build_model(dataclasses.replace(tiny_cfg, **{"window": 2, **changes})).eval()  # window: sparse kernels


def randomise_norms(model):
    """Init leaves norms at gamma=1, beta=0; random values make the oracle tests see them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("weight") else 0.3 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------------------------------ hand-written forward


def ln(x, norm):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return norm.weight * (x - mu) / torch.sqrt(var + norm.eps) + norm.bias


def hand_attention(x, attn):
    B, T, _ = x.shape
    H, Dh = attn.n_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(B, T, H, Dh)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(B, T, H, Dh)
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).view(B, T, H, Dh)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    heads = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, H * Dh)
    return heads @ attn.o_proj.weight.T + attn.o_proj.bias


def hand_mlp(x, ffn):
    hidden = x @ ffn.up_proj.weight.T + ffn.up_proj.bias
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))  # exact GELU
    return hidden @ ffn.down_proj.weight.T + ffn.down_proj.bias


def hand_decoder(model, ids, placement):
    """H0 = one_hot(x) W_E + P[0..T); pre: x + F(LN(x)), post: LN(x + F(x)), sandwich: x + LN_o(F(LN_i(x)));
    logits = LN_f(H) W_E^T (no LN_f after post)."""
    T = ids.shape[1]
    one_hot = torch.nn.functional.one_hot(ids, model.tok_emb.weight.shape[0]).to(model.tok_emb.weight.dtype)
    h = one_hot @ model.tok_emb.weight + model.positional.weight[:T]
    for block in model.blocks:
        if placement == "pre":
            h = h + hand_attention(ln(h, block.attn_norm), block.attn)
            h = h + hand_mlp(ln(h, block.ffn_norm), block.ffn)
        elif placement == "sandwich":  # x + LN_out(F(LN_in(x)))
            h = h + ln(hand_attention(ln(h, block.attn_norm.inner), block.attn), block.attn_norm.outer)
            h = h + ln(hand_mlp(ln(h, block.ffn_norm.inner), block.ffn), block.ffn_norm.outer)
        else:
            h = ln(h + hand_attention(h, block.attn), block.attn_norm)
            h = ln(h + hand_mlp(h, block.ffn), block.ffn_norm)
    if placement != "post":
        h = ln(h, model.final_norm)
    return h @ model.tok_emb.weight.T


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_logits_equal_the_hand_written_forward(tiny_cfg, placement, kernel):
    model = randomise_norms(model_for(tiny_cfg, positional="learned", norm="layernorm", activation="gelu",
                                      ffn="mlp", norm_placement=placement, attention=kernel)).double()
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hand_decoder(model, ids, placement), rtol=1e-10, atol=1e-10)


def test_embedding_lookup_is_a_one_hot_matmul_and_its_gradient_a_scatter_add(tiny_cfg):
    """SPEC claim 13."""
    model = model_for(tiny_cfg).double()
    ids = torch.tensor([[3, 5, 3, 0]])
    weight = model.tok_emb.weight
    one_hot = torch.nn.functional.one_hot(ids, 32).double()
    torch.testing.assert_close(model.tok_emb(ids), one_hot @ weight, rtol=0, atol=0)
    upstream = torch.randn(1, 4, 16, dtype=torch.float64)
    (grad,) = torch.autograd.grad(model.tok_emb(ids), weight, upstream)
    expected = torch.zeros_like(weight).index_add_(0, ids[0], upstream[0])
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    assert torch.equal(grad[3], upstream[0, 0] + upstream[0, 2])


# ------------------------------------------------------------------------------------------ causality


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_changing_a_token_leaves_earlier_logits_unchanged(tiny_cfg, positional, kernel):
    model = model_for(tiny_cfg, positional=positional, attention=kernel)
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        base = model(ids)
        for t in (0, 3, 6):
            changed = ids.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1 + torch.arange(2)) % 32
            out = model(changed)
            torch.testing.assert_close(out[:, :t + 1], base[:, :t + 1], rtol=1e-5, atol=1e-5)
            assert (out[:, t + 1] - base[:, t + 1]).abs().max() > 1e-4  # the changed position did change


# ------------------------------------------------------------------------------------------ permutations


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_without_positions_one_layer_sees_its_prefix_as_a_set(tiny_cfg, kernel):
    """With positional 'none' and L = 1, the last query attends to keys/values that each depend on one
    token only, so permuting the tokens before it leaves its logits unchanged. (With L >= 2 the second
    layer's keys depend on each token's causal prefix, so the math guarantees nothing there.)"""
    model = model_for(tiny_cfg, positional="none", n_layers=1, attention=kernel)
    ids = torch.randint(0, 32, (3, 7))
    perm = torch.tensor([4, 2, 0, 5, 1, 3, 6])  # last token stays last
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, perm])[:, -1], model(ids)[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes", [dict(positional="learned", n_layers=1), dict(positional="none", n_layers=2)])
def test_prefix_order_matters_with_positions_or_depth(tiny_cfg, changes):
    """The invariance above is not vacuous: positions or a second layer break it."""
    model = model_for(tiny_cfg, **changes)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    perm = torch.tensor([4, 2, 0, 5, 1, 3, 6])
    with torch.no_grad():
        assert (model(ids[:, perm])[:, -1] - model(ids)[:, -1]).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------ weight tying


def test_tied_embeddings_share_storage_and_gradient(tiny_cfg):
    model = model_for(tiny_cfg, tie_embeddings=True)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = model_for(tiny_cfg, tie_embeddings=False)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in untied.parameters()) - 32 * 16
    # an untied copy holding W_E in both places: the shared gradient is the sum of its two gradients
    state = dict(model.state_dict())
    untied.load_state_dict(state)
    assert torch.equal(untied.lm_head.weight, untied.tok_emb.weight)
    ids = torch.randint(0, 32, (2, 5))
    model(ids).square().sum().backward()
    untied(ids).square().sum().backward()
    embedding_part, head_part = untied.tok_emb.weight.grad, untied.lm_head.weight.grad
    assert embedding_part.abs().max() > 1e-6 and head_part.abs().max() > 1e-6
    torch.testing.assert_close(model.tok_emb.weight.grad, embedding_part + head_part, rtol=1e-5, atol=1e-7)


def test_untied_embeddings_are_separate_tensors(tiny_cfg):
    model = model_for(tiny_cfg, tie_embeddings=False)
    assert model.lm_head.weight is not model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    with torch.no_grad():
        model.tok_emb.weight.zero_()
    assert model.lm_head.weight.abs().max() > 0


# ------------------------------------------------------------------------------------------ padding and cache


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_left_padding_leaves_real_token_logits_unchanged(tiny_cfg, positional, kernel):
    model = model_for(tiny_cfg, positional=positional, attention=kernel)
    short, full = torch.randint(1, 32, (1, 4)), torch.randint(1, 32, (1, 6))
    batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1), full])  # (2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        assert torch.isfinite(padded).all()  # pad queries see their own column: no NaN
        torch.testing.assert_close(padded[0, 2:], model(short)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded[1], model(full)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_kv_cache_incremental_logits_equal_the_full_forward(tiny_cfg, positional, kernel):
    model = model_for(tiny_cfg, positional=positional, attention=kernel, n_kv_heads=2)
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 8)
        pieces = [model(ids[:, :3], cache=cache)]  # prefill
        pieces += [model(ids[:, t:t + 1], cache=cache) for t in range(3, 8)]  # one token at a time
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("positional", POSITIONAL_NAMES)
def test_kv_cache_after_a_left_padded_prefill_equals_each_rows_own_forward(tiny_cfg, positional, kernel):
    model = model_for(tiny_cfg, positional=positional, attention=kernel)
    rows = [torch.randint(1, 32, (1, 6)), torch.randint(1, 32, (1, 4))]  # second row: 2 pads
    prompt = torch.cat([rows[0][:, :3], torch.cat([torch.zeros(1, 2, dtype=torch.long), rows[1][:, :1]], 1)])
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    with torch.no_grad():
        cache = model.new_cache(2, 6)
        first = model(prompt, attention_mask=mask, cache=cache)
        steps = [model(torch.stack([rows[0][0, t], rows[1][0, t - 2]])[:, None], cache=cache) for t in range(3, 6)]
        own = [model(row)[0] for row in rows]
    torch.testing.assert_close(first[0], own[0][:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1, 2], own[1][0], rtol=1e-5, atol=1e-5)
    for i, step in enumerate(steps):
        torch.testing.assert_close(step[0, 0], own[0][3 + i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[1, 0], own[1][1 + i], rtol=1e-5, atol=1e-5)


def bigram_model(tiny_cfg):
    model = model_for(tiny_cfg, positional="rope", bigram_vocab=29)
    torch.nn.init.normal_(model.bigram_emb.weight)  # zero at init: give the pairs rows that change the logits
    return model


def test_a_bigram_decoders_cache_carries_each_rows_last_token(tiny_cfg):
    """Prefill a left-padded batch, decode token by token, then reorder the rows (beam search): each step's
    pair is (the row's previous real token, this token), so every logit equals the row's own full forward."""
    model = bigram_model(tiny_cfg)
    rows = [torch.randint(1, 32, (1, 7)), torch.randint(1, 32, (1, 5))]  # second row: 2 pads
    prompt = torch.cat([rows[0][:, :3], torch.cat([torch.zeros(1, 2, dtype=torch.long), rows[1][:, :1]], 1)])
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    with torch.no_grad():
        own = [model(row)[0] for row in rows]
        cache = model.new_cache(2, 7)
        first = model(prompt, attention_mask=mask, cache=cache)
        steps = [model(torch.stack([rows[0][0, t], rows[1][0, t - 2]])[:, None], cache=cache) for t in range(3, 6)]
        cache.reorder(torch.tensor([1, 0]))  # the rows swap places
        last = model(torch.stack([rows[1][0, 4], rows[0][0, 6]])[:, None], cache=cache)
        unpaired = copy.deepcopy(model)
        unpaired.bigram_emb.weight.zero_()
        assert (own[0] - unpaired(rows[0])[0]).abs().max() > 1e-3  # the pairs change these logits
    torch.testing.assert_close(first[0], own[0][:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1, 2], own[1][0], rtol=1e-5, atol=1e-5)
    for i, step in enumerate(steps):
        torch.testing.assert_close(step[0, 0], own[0][3 + i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[1, 0], own[1][1 + i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[0, 0], own[1][4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last[1, 0], own[0][6], rtol=1e-5, atol=1e-5)


def test_cache_overflow_is_an_error(tiny_cfg):
    model = model_for(tiny_cfg)
    cache = model.new_cache(1, 4)
    model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_eval_mode_disables_every_dropout_and_train_mode_applies_it(tiny_cfg):
    model = model_for(tiny_cfg, dropout=0.5)
    reference = model_for(tiny_cfg, dropout=0.0)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
        assert (model.train()(ids) - reference(ids)).abs().max() > 1e-3


def test_a_soft_capped_decoder_is_c_tanh_of_the_plain_decoders_logits(tiny_cfg):
    """Same weights (the same parameter names: a cap adds none), logits c tanh(z / c), still tied; the training
    loss (the chunked head) equals F.cross_entropy of those logits."""
    from qkv.train.objectives import lm_loss

    cap = 0.1
    plain = build_model(tiny_cfg).double()
    capped = build_model(dataclasses.replace(tiny_cfg, logit_softcap=cap)).double()
    capped.load_state_dict(plain.state_dict())
    assert capped.lm_head.weight is capped.tok_emb.weight
    x = torch.randint(0, tiny_cfg.vocab_size, (2, 9))
    z = plain(x)
    assert z.abs().max() > cap  # the cap bends some of these logits
    torch.testing.assert_close(capped(x), cap * torch.tanh(z / cap), rtol=1e-12, atol=1e-12)
    targets = torch.randint(0, tiny_cfg.vocab_size, (2, 9))
    expected = torch.nn.functional.cross_entropy(capped(x).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(lm_loss(capped, (x, targets), 0.0), expected, rtol=1e-12, atol=1e-12)


def test_logits_to_keep_gives_the_last_positions_logits(tiny_cfg):
    """model(..., logits_to_keep=k): the head on the last k positions only, equal to the whole forward's last k
    (a prefill needs one); with a cache and padding too."""
    model = model_for(tiny_cfg)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        for k in (1, 3):
            kept = model(ids, attention_mask=mask, cache=model.new_cache(2, 7), logits_to_keep=k)
            assert kept.shape == (2, k, tiny_cfg.vocab_size)
            torch.testing.assert_close(kept, full[:, -k:], rtol=1e-5, atol=1e-5)
            hidden = model(ids, attention_mask=mask, logits_to_keep=k, head=False)  # what the head multiplies
            assert hidden.stride() == (k * tiny_cfg.d_model, tiny_cfg.d_model, 1)  # fresh strides: not (T D, D, 1)
