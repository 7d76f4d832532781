"""The encoder heads (qkv.models.heads) against their formulas written out by hand: the poolings, BERT's
MLM head (logits = LN(act(H W_t + b_t)) W_E^T + b_V, W_E tied) and the classifier (tanh pooler, then the
class projection); `head=False` is the encoder's output the head reads."""
import torch
import torch.nn.functional as F

import qkv
from qkv.models.heads import POOLINGS

MLM = dict(arch="encoder", head="mlm", vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=12)


def test_first_pools_the_first_position():
    hidden = torch.randn(3, 5, 4)
    torch.testing.assert_close(POOLINGS.get("first")(hidden, None), hidden[:, 0])


def test_mean_pools_the_real_tokens_only():
    """Row 0: all 4 tokens; row 1: the first 2 (the padded positions hold large values that must not count)."""
    hidden = torch.randn(2, 4, 3)
    hidden[1, 2:] = 1e6
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    pooled = POOLINGS.get("mean")(hidden, mask)
    torch.testing.assert_close(pooled[0], hidden[0].mean(0))
    torch.testing.assert_close(pooled[1], hidden[1, :2].mean(0))
    torch.testing.assert_close(POOLINGS.get("mean")(hidden[:1], None), hidden[:1].mean(1))


def test_mlm_logits_are_the_heads_formula_on_the_encoder_output():
    torch.manual_seed(0)
    model = qkv.build_model(qkv.ModelConfig(**MLM)).eval()
    ids = torch.randint(0, 40, (2, 7))
    hidden = model(ids, head=False)  # (B, T, D): the encoder's output
    torch.testing.assert_close(hidden, model.encoder(ids))
    head = model.head
    assert head.decoder.weight is model.encoder.tok_emb.weight  # tied: W_V = W_E
    t = F.linear(hidden, head.transform.weight, head.transform.bias)
    normed = F.layer_norm(head.activation(t), (16,), head.norm.weight, head.norm.bias, head.norm.eps)
    logits = normed @ model.encoder.tok_emb.weight.T + head.decoder.bias  # (B, T, V)
    torch.testing.assert_close(model(ids), logits)
    torch.testing.assert_close(head.features(hidden), normed)


def test_classifier_is_tanh_pooler_then_projection():
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(**{**MLM, "head": "classifier", "n_classes": 3, "pooling": "mean"})
    model = qkv.build_model(cfg).eval()
    ids, mask = torch.randint(0, 40, (2, 6)), torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    hidden = model.encoder(ids, mask)
    pooled = torch.stack([hidden[0].mean(0), hidden[1, :3].mean(0)])  # (B, D)
    head = model.head
    want = torch.tanh(pooled @ head.pooler.weight.T + head.pooler.bias) @ head.out_proj.weight.T + head.out_proj.bias
    torch.testing.assert_close(model(ids, mask), want)
