"""The one embedding equation H0 = Dropout(Norm_emb(P(E[x] * s + T[type]))) of qkv.nn.embedding, checked
against its terms written out with one-hot matrices, for each family's options; and the parameter names
each family keeps on the model itself."""
import dataclasses
import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.positional import sinusoidal_table

FAMILIES = {
    "decoder": dict(arch="decoder", positional="learned"),
    "bert": dict(arch="encoder", positional="learned", type_vocab_size=2, embed_norm=True),
    "vaswani": dict(arch="encoder-decoder", positional="sinusoidal", embed_scale=True),
}


def written_out(model, ids, types, cfg):
    W = model.tok_emb.weight.double()
    one_hot = torch.nn.functional.one_hot(ids, cfg.vocab_size).double()
    x = one_hot @ W * (math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0)  # E[x] * s
    if cfg.type_vocab_size:
        x = x + torch.nn.functional.one_hot(types, cfg.type_vocab_size).double() @ model.type_emb.weight.double()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if cfg.positional == "learned":
        x = x + model.positional.weight.double()[positions]
    else:
        x = x + sinusoidal_table(positions, cfg.d_model, dtype=torch.float64)
    if cfg.embed_norm:
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        x = (x - mu) / torch.sqrt(var + cfg.norm_eps) * model.embed_norm.weight.double() + model.embed_norm.bias.double()
    return x


@pytest.mark.parametrize("family", FAMILIES)
def test_embedding_equals_its_terms_written_out(family):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=12, **FAMILIES[family])
    model = build_model(cfg).double().eval()
    with torch.no_grad():  # non-trivial norm parameters
        if cfg.embed_norm:
            model.embed_norm.weight.uniform_(0.5, 1.5)
            model.embed_norm.bias.normal_()
        if cfg.positional == "learned":
            model.positional.weight.normal_()
    ids = torch.randint(0, 40, (3, 7))
    types = torch.randint(0, 2, (3, 7))
    positions = torch.arange(7).expand_as(ids)
    got = model.embed(ids, positions, types if cfg.type_vocab_size else None)
    torch.testing.assert_close(got, written_out(model, ids, types, cfg), rtol=1e-12, atol=1e-12)


def test_types_default_to_type_zero():
    cfg = ModelConfig(arch="encoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, type_vocab_size=2)
    model = build_model(cfg).eval()
    ids, positions = torch.randint(0, 40, (2, 5)), torch.arange(5).expand(2, 5)
    torch.testing.assert_close(model.embed(ids, positions), model.embed(ids, positions, torch.zeros_like(ids)),
                               rtol=0, atol=0)


def test_parameters_keep_their_names_on_the_model():
    names = {family: {n for n, _ in build_model(ModelConfig(vocab_size=40, d_model=16, n_heads=2, n_layers=1,
                                                             d_ff=32, **fields)).named_parameters()}
             for family, fields in FAMILIES.items()}
    assert {"tok_emb.weight", "positional.weight"} <= names["decoder"]
    assert {"tok_emb.weight", "type_emb.weight", "positional.weight", "embed_norm.weight",
            "embed_norm.bias"} <= names["bert"]
    assert "tok_emb.weight" in names["vaswani"] and not any(n.startswith("embed.") for n in set().union(*names.values()))


def test_dropout_applies_to_the_whole_embedding_in_training():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.5))
    ids, positions = torch.randint(0, 40, (4, 6)), torch.arange(6).expand(4, 6)
    model.eval()
    clean = model.embed(ids, positions)
    model.train()
    dropped = model.embed(ids, positions)
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7  # about half the entries survive
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])  # survivors scaled by 1 / (1 - p)


def test_bigram_rows_are_the_hash_of_each_pair_and_the_reference_engines():
    """h(p, c) = (36313 c XOR 27191 p) mod (N - 1), computed with Python integers; N - 1 for a token with no
    previous one (column 0, after padding); the NumPy engine's own version gives the same rows."""
    from qkv.nn.embedding import bigram_rows, previous_tokens
    from qkv.ref.model import bigram_rows as ref_bigram_rows

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding: column 4 is the row's first token
    rows = bigram_rows(previous_tokens(ids, mask), ids, 1000)
    for b in range(3):
        for t in range(9):
            first = t == 0 or not mask[b, t - 1]
            expected = 999 if first else (36313 * int(ids[b, t]) ^ 27191 * int(ids[b, t - 1])) % 999
            assert int(rows[b, t]) == expected, (b, t)
    assert (rows[1, :5] == 999).all() and rows.min() >= 0 and rows.max() <= 999
    assert (rows.numpy() == ref_bigram_rows(ids.numpy(), mask.numpy(), 1000)).all()


def test_a_bigram_decoders_h0_adds_the_hashed_pair_rows_and_starts_as_the_plain_decoder():
    """H0 = E[x_t] + E_2[h(x_{t-1}, x_t)] (+ P), written with one-hot matrices; at init E_2 = 0, so the
    model's logits are the plain decoder's with the same weights."""
    from qkv.nn.embedding import bigram_rows, previous_tokens

    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32,
                      positional="learned", bigram_vocab=40)
    model = build_model(cfg).double()
    plain = build_model(dataclasses.replace(cfg, bigram_vocab=0)).double()
    state = {k: v for k, v in model.state_dict().items() if k != "bigram_emb.weight"}
    plain.load_state_dict(state)
    assert model.bigram_emb.weight.abs().max() == 0  # zero at init, whatever model.init
    ids = torch.randint(0, 32, (2, 7))
    torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=0)
    torch.nn.init.normal_(model.bigram_emb.weight)
    one_hot = torch.nn.functional.one_hot(bigram_rows(previous_tokens(ids), ids, 40), 40).double()
    expected = written_out(plain, ids, None, cfg) + one_hot @ model.bigram_emb.weight
    positions = torch.arange(7).expand_as(ids)
    torch.testing.assert_close(model.embed(ids, positions), expected, rtol=1e-12, atol=1e-12)
