"""One layer (qkv.nn.block.Block): its forward is the composition the residual placement defines, each
sublayer in order (note 000 §5.1-§5.3): pre-LN x + F(LN x) for attention then FFN; post-LN LN(x + F(x)); a
decoder layer of an encoder-decoder adds cross-attention over the memory between them."""
import dataclasses

import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.models.context import cross_context, self_context

CFG = ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=12, dropout=0.0)


def layer_and_context(cfg: ModelConfig):
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    ids = torch.randint(cfg.vocab_size, (2, 7))
    ctx = self_context(model.positional, ids, None, None, causal=True)
    x = torch.randn(2, 7, cfg.d_model, dtype=torch.float64)
    return model.blocks[0], ctx, x


def test_pre_ln_block_is_two_residual_sublayers():
    block, ctx, x = layer_and_context(CFG)
    h = x + block.attn(block.attn_norm(x), ctx)
    want = h + block.ffn(block.ffn_norm(h))
    torch.testing.assert_close(block(x, ctx), want, rtol=1e-12, atol=1e-12)


def test_post_ln_block_normalises_after_each_residual():
    block, ctx, x = layer_and_context(dataclasses.replace(CFG, norm_placement="post"))
    h = block.attn_norm(x + block.attn(x, ctx))
    want = block.ffn_norm(h + block.ffn(h))
    torch.testing.assert_close(block(x, ctx), want, rtol=1e-12, atol=1e-12)


def test_a_decoder_layer_reads_the_memory_between_self_attention_and_ffn():
    cfg = dataclasses.replace(CFG, arch="encoder-decoder", n_encoder_layers=1, n_decoder_layers=1)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    block = model.blocks[0]  # the decoder's layer (the encoder's are model.encoder's)
    assert block.cross_attn is not None
    ids = torch.randint(cfg.vocab_size, (2, 5))
    ctx = self_context(model.positional, ids, None, None, causal=True)
    memory = torch.randn(2, 9, cfg.d_model, dtype=torch.float64)
    memory_ctx = cross_context(ctx.positions, None, 9)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    h = x + block.attn(block.attn_norm(x), ctx)
    h = h + block.cross_attn(block.cross_norm(h), memory_ctx, None, memory)
    want = h + block.ffn(block.ffn_norm(h))
    torch.testing.assert_close(block(x, ctx, memory=memory, memory_ctx=memory_ctx), want, rtol=1e-12, atol=1e-12)
