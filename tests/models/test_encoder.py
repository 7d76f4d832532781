"""Encoder-only models (BERT style; note 000 §7, §18.1, §20 item 1; note 003; SPEC A7): permutation
equivariance without positions, padding, bidirectionality, token types, the MLM and classifier heads,
and Hugging Face BERT as a numeric oracle."""
import pytest
import torch
import torch.nn.functional as F

from qkv import presets
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.models.build import check_model
from qkv.models.encoder import Encoder
from qkv.models.heads import EncoderClassifier, EncoderMLM
from qkv.nn import registries
from tests.models.derivative import assert_gradient_is_the_derivative

V = 40


def config(**overrides) -> ModelConfig:
    base = dict(arch="encoder", vocab_size=V, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def model(**overrides):
    return build_model(config(**overrides)).double().eval()


def ids(*shape) -> torch.Tensor:
    return torch.randint(0, V, shape)


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("kernel", ["naive", "sdpa"])
def test_permuting_tokens_permutes_outputs_without_positions(placement, kernel):
    """Self-attention is permutation-equivariant (note 000 §20 item 1): f(x P) = f(x) P, also with padding."""
    m = build_model(config(positional="none", norm_placement=placement, attention=kernel)).eval()
    x, mask = ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    perm = torch.randperm(9)
    torch.testing.assert_close(m(x[:, perm], mask[:, perm]), m(x, mask)[:, perm], atol=1e-6, rtol=0)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("positional", registries.get("positional").names())
def test_padding_changes_no_real_token(side, positional):
    m, x = model(positional=positional), ids(2, 6)
    pad = ids(2, 3)  # arbitrary ids under the padding
    padded = torch.cat((x, pad), 1) if side == "right" else torch.cat((pad, x), 1)
    mask = torch.zeros(2, 9, dtype=torch.long)
    real = slice(0, 6) if side == "right" else slice(3, 9)
    mask[:, real] = 1
    torch.testing.assert_close(m(padded, attention_mask=mask)[:, real], m(x), atol=1e-10, rtol=0)


def test_attention_is_bidirectional():
    """Unlike the decoder, the first token's state depends on the last token."""
    m, x = model(), ids(2, 6)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    assert not torch.allclose(m(x)[:, 0], m(changed)[:, 0], atol=1e-6)


def test_token_types_add_a_learned_embedding_and_default_to_type_zero():
    m, x = model(type_vocab_size=2), ids(2, 5)
    zeros, ones = torch.zeros_like(x), torch.ones_like(x)
    torch.testing.assert_close(m(x), m(x, None, zeros), atol=0, rtol=0)
    assert not torch.allclose(m(x, None, zeros), m(x, None, ones))
    assert m.type_emb.weight.shape == (2, 16) and model().type_emb is None


def test_bare_encoder_returns_the_hidden_states_a_head_reads():
    """model.head='none' is the encoder itself: with the same weights, its output is the hidden state the
    MLM head of an EncoderMLM receives."""
    bare, mlm, x = model(), model(head="mlm"), ids(3, 5)
    assert isinstance(bare, Encoder)
    mlm.encoder.load_state_dict(bare.state_dict())
    torch.testing.assert_close(bare(x), mlm.encoder(x), rtol=0, atol=0)
    hidden = []
    mlm.head.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
    mlm(x)
    torch.testing.assert_close(hidden[0], bare(x), rtol=0, atol=0)


def test_mlm_head_is_the_hand_computation_with_the_tied_decoder():
    """logits = LN(gelu(H W_t + b_t)) W_E^T + b_V (BERT's prediction head; W_E shared with the embedding)."""
    m, x = model(head="mlm"), ids(2, 5)
    assert isinstance(m, EncoderMLM) and m.head.decoder.weight is m.encoder.tok_emb.weight
    head = m.head
    hidden = m.encoder(x)
    transformed = F.gelu(hidden @ head.transform.weight.T + head.transform.bias)
    normed = F.layer_norm(transformed, (16,), head.norm.weight, head.norm.bias, eps=1e-5)
    expected = normed @ m.encoder.tok_emb.weight.T + head.decoder.bias
    torch.testing.assert_close(m(x), expected, atol=1e-12, rtol=0)
    assert torch.equal(head.decoder.bias, torch.zeros(V))  # initialised to zero, as BERT's


def test_untied_mlm_head_has_its_own_matrix():
    m = model(head="mlm", tie_embeddings=False)
    assert m.head.decoder.weight is not m.encoder.tok_emb.weight


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_classifier_pooling_is_the_hand_computation(pooling):
    m, x = model(head="classifier", n_classes=3, pooling=pooling), ids(2, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    assert isinstance(m, EncoderClassifier)
    hidden = m.encoder(x, mask)
    if pooling == "first":
        pooled = hidden[:, 0]
    else:  # the mean over each row's real tokens: row 1 averages its first 4 states
        pooled = torch.stack((hidden[0].mean(0), hidden[1, :4].sum(0) / 4))
    head = m.head
    pooler = torch.tanh(pooled @ head.pooler.weight.T + head.pooler.bias)
    expected = pooler @ head.out_proj.weight.T + head.out_proj.bias
    torch.testing.assert_close(m(x, mask), expected, atol=1e-12, rtol=0)
    assert m(x, mask).shape == (2, 3)


@pytest.mark.parametrize("head", ["mlm", "classifier"])
def test_every_encoder_parameter_gets_the_derivative_through_the_head(head):
    m = build_model(config(head=head, n_classes=2, type_vocab_size=2, embed_norm=True)).double()
    x, mask = ids(2, 5), torch.tensor([[1] * 5, [1] * 3 + [0] * 2])
    m(x, mask).square().sum().backward()
    for name, param in m.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert_gradient_is_the_derivative(m, lambda model: model(x, mask).square().sum())


@pytest.mark.parametrize("fields, message", [
    (dict(head="mlm", arch="decoder"), "model.head='mlm' needs model.arch='encoder', got model.arch='decoder'"),
    (dict(head="classifier"), "model.n_classes=0 must be at least 2 with model.head='classifier'"),
    (dict(head="pooler"), "model.head='pooler' is not allowed; choose from: classifier, mlm, none"),
    (dict(pooling="max"), "model.pooling='max' is not allowed; choose from: first, mean"),
    (dict(arch="encoder-decoder", type_vocab_size=2), "model.type_vocab_size=2 needs model.arch='encoder'"),
])
def test_family_fields_are_validated(fields, message):
    with pytest.raises(QkvError, match=message.replace("(", r"\(")):
        check_model(config(**fields))


def test_bert_base_has_the_parameters_of_hugging_face_bert_for_masked_lm():
    """109,514,298: BertForMaskedLM (no pooler; the MLM transform, its LayerNorm and the output bias)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.BertForMaskedLM(transformers.BertConfig())  # the bert-base-uncased defaults
        ours = build_model(presets.get("bert-base").model)
    assert sum(p.numel() for p in ours.parameters()) == hf.num_parameters() == 109_514_298


def test_logits_match_hugging_face_bert_for_masked_lm():
    """Post-LN, learned positions, token types, embedding LayerNorm, exact GELU, tied MLM decoder."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=32, max_position_embeddings=32, type_vocab_size=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     layer_norm_eps=1e-12, attn_implementation="eager")
    hf = transformers.BertForMaskedLM(hf_cfg).double().eval()
    ours = model(head="mlm", norm_placement="post", type_vocab_size=2, embed_norm=True, norm_eps=1e-12)
    theirs = hf.state_dict()
    state = {"encoder.tok_emb.weight": theirs["bert.embeddings.word_embeddings.weight"],
             "encoder.type_emb.weight": theirs["bert.embeddings.token_type_embeddings.weight"],
             "encoder.positional.weight": theirs["bert.embeddings.position_embeddings.weight"],
             "head.decoder.bias": theirs["cls.predictions.bias"]}
    names = {"embed_norm": "bert.embeddings.LayerNorm", "head.transform": "cls.predictions.transform.dense",
             "head.norm": "cls.predictions.transform.LayerNorm"}
    for i in range(2):
        layer = f"bert.encoder.layer.{i}."
        names.update({f"blocks.{i}.attn.q_proj": layer + "attention.self.query",
                      f"blocks.{i}.attn.k_proj": layer + "attention.self.key",
                      f"blocks.{i}.attn.v_proj": layer + "attention.self.value",
                      f"blocks.{i}.attn.o_proj": layer + "attention.output.dense",
                      f"blocks.{i}.attn_norm": layer + "attention.output.LayerNorm",
                      f"blocks.{i}.ffn.up_proj": layer + "intermediate.dense",
                      f"blocks.{i}.ffn.down_proj": layer + "output.dense",
                      f"blocks.{i}.ffn_norm": layer + "output.LayerNorm"})
    for mine, hf_name in names.items():
        prefix = mine if mine.startswith("head") else "encoder." + mine
        for part in ("weight", "bias"):
            state[f"{prefix}.{part}"] = theirs[f"{hf_name}.{part}"]
    assert set(dict(ours.named_parameters())) <= set(state)
    ours.load_state_dict(state, strict=False)
    x, types = torch.randint(0, V, (2, 7)), torch.randint(0, 2, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    expected = hf(input_ids=x, attention_mask=mask, token_type_ids=types).logits
    got = ours(x, mask, types)
    torch.testing.assert_close(got[0], expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[1, :5], expected[1, :5], atol=1e-10, rtol=1e-10)  # real tokens
