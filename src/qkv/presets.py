"""Named configurations, each a function returning a RunConfig (as torchtitan's flavours).

`qkv presets` lists them with the first line of each docstring.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from qkv.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from qkv.registry import Registry

PRESETS: Registry[Callable[[], RunConfig]] = Registry("preset")


def get(name: str) -> RunConfig:
    return PRESETS.get(name)()


def describe(name: str) -> str:
    return (PRESETS.get(name).__doc__ or "").strip().splitlines()[0]


# The default job's optimizer and schedule (docs/recipe.md): Muon on the hidden matrices, AdamW on the rest,
# warmup-stable-decay with the last 30% decaying to min_lr. Shared by the small presets that train on the
# bundled corpus (shakespeare, bert-shakespeare, folio); each keeps its own warmup and batch.
RECIPE = dict(optimizer="muon", lr=4e-3, muon_lr=0.01, min_lr=1e-4, schedule="wsd", decay_fraction=0.3,
              weight_decay=0.1)


@PRESETS.register("tiny")
def tiny() -> RunConfig:
    """A 2-layer, 32-wide decoder that trains in seconds: for tests and smoke runs."""
    return RunConfig(
        model=ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64),
        train=TrainConfig(batch_size=8, seq_len=32, max_steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                          eval_batches=2, log_every=5),
        data=DataConfig(vocab_size=300),
    )


@PRESETS.register("shakespeare")
def shakespeare() -> RunConfig:
    """The default job: a BPE decoder LM trained for 5 minutes on the bundled modern-spelling works."""
    # Sized for 300 s on 2 CPU cores (about 2.1M tokens): a 128-wide, 4-layer model with rotary positions;
    # Muon on the hidden matrices with AdamW on the rest, a warmup-stable-decay schedule (its cooldown 1 - sqrt)
    # and batches of 8 x 256 tokens after a ramp from 2 rows over the first 300 updates (about 1,150 updates).
    # Each choice was measured at fixed steps and at equal time (docs/recipe.md; the cooldown's shape at fixed
    # steps only: it costs no time).
    return RunConfig(
        model=ModelConfig(d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=256, dropout=0.0,
                          positional="rope"),
        train=TrainConfig(batch_size=8, seq_len=256, max_steps=100_000, max_time=300.0, **RECIPE, decay_shape="sqrt",
                          precision="auto", warmup_steps=30, batch_warmup_start=2, batch_warmup_steps=300, eval_every=0,
                          eval_batches=8, log_every=10),
        data=DataConfig(vocab_size=2048),
    )


@PRESETS.register("gpt2-124m")
def gpt2_124m() -> RunConfig:
    """GPT-2 small: 12 layers, 768 wide, 12 heads, learned positions, Pre-LN, GELU, tied head."""
    return RunConfig(
        model=ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024,
                          activation="gelu_tanh"),
        train=TrainConfig(batch_size=32, seq_len=1024, lr=6e-4, min_lr=6e-5, warmup_steps=700, max_steps=20_000),
        data=DataConfig(vocab_size=50257),
    )


@PRESETS.register("llama-small")
def llama_small() -> RunConfig:
    """A small LLaMA-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head."""
    return RunConfig(
        model=ModelConfig(vocab_size=32000, d_model=512, n_heads=8, n_kv_heads=2, n_layers=8, d_ff=1376,
                          max_seq_len=1024, positional="rope", norm="rmsnorm", ffn="glu", activation="silu",
                          bias=False, tie_embeddings=False),
        train=TrainConfig(batch_size=32, seq_len=1024, lr=3e-4, min_lr=3e-5, warmup_steps=500),
        data=DataConfig(vocab_size=32000),
    )


@PRESETS.register("gpt3-175b")
def gpt3_175b() -> RunConfig:
    """GPT-3 175B (96 layers, 12288 wide, 96 heads, 2048 context): for the calculators, not for training."""
    return RunConfig(
        model=ModelConfig(vocab_size=50257, d_model=12288, n_heads=96, n_layers=96, d_ff=4 * 12288,
                          max_seq_len=2048, activation="gelu_tanh"),
        train=TrainConfig(batch_size=1536, seq_len=2048, lr=6e-5, min_lr=6e-6, warmup_steps=375),
        data=DataConfig(vocab_size=50257),
    )


@PRESETS.register("bert-base")
def bert_base() -> RunConfig:
    """BERT-base (Devlin et al. 2019): 12-layer Post-LN encoder, 768 wide, 12 heads, GELU, MLM head, 2 token types."""
    return RunConfig(
        model=ModelConfig(arch="encoder", head="mlm", vocab_size=30522, d_model=768, n_heads=12, n_layers=12,
                          d_ff=3072, max_seq_len=512, positional="learned", norm="layernorm", norm_eps=1e-12,
                          norm_placement="post", activation="gelu", type_vocab_size=2, embed_norm=True,
                          dropout=0.1),
        # BERT's phase 1: 128-token sequences, Adam (1e-4, b2 0.999, decay 0.01), 10k warmup, linear decay
        train=TrainConfig(batch_size=256, seq_len=128, max_steps=1_000_000, lr=1e-4, min_lr=0.0, schedule="linear",
                          warmup_steps=10_000, weight_decay=0.01, beta2=0.999, eps=1e-6),
        data=DataConfig(vocab_size=30522),
    )


@PRESETS.register("bert-shakespeare")
def bert_shakespeare() -> RunConfig:
    """A small BERT pretrained by masked LM for 5 minutes on the modern works; `--task classify` fine-tunes it."""
    # 4 Pre-LN layers, 128 wide (the default decoder's size: about 2M tokens in 300 s on 2 CPU cores), BERT's
    # 15% / 80-10-10 masking on 128-token windows. data.split=genre keeps the genre task's validation and test
    # plays out of pretraining too (qkv.data.genres), so fine-tuned accuracy is measured on unseen text.
    # The default job's recipe (docs/recipe.md): rotary positions, Muon on the hidden matrices with AdamW on
    # the rest, warmup-stable-decay: masked-token accuracy at 300 s 36.7% against 16.5% with learned positions,
    # AdamW and cosine (docs/tasks.md)
    return RunConfig(
        model=ModelConfig(arch="encoder", head="mlm", d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=128,
                          positional="rope", norm_placement="pre", activation="gelu", embed_norm=True,
                          dropout=0.0),
        train=TrainConfig(batch_size=16, seq_len=128, max_steps=100_000, max_time=300.0, **RECIPE,
                          warmup_steps=50, beta2=0.98, eval_batches=8, log_every=10),
        data=DataConfig(vocab_size=2048, split="genre"),
    )


@PRESETS.register("t5-small")
def t5_small() -> RunConfig:
    """T5-small (Raffel et al. 2020): 6+6 Pre-LN layers, 512 wide, 8 heads, RMSNorm, ReLU FFN 2048, no biases."""
    return RunConfig(
        # T5's bucketed relative bias: 32 buckets up to distance 128, bidirectional in the encoder, causal
        # ("t5_causal") in the decoder (qkv.models.build.decoder_positional)
        model=ModelConfig(arch="encoder-decoder", vocab_size=32128, d_model=512, n_heads=8, n_layers=6, d_ff=2048,
                          max_seq_len=512, positional="t5", max_distance=128, norm="rmsnorm", norm_eps=1e-6,
                          norm_placement="pre", activation="relu", bias=False, dropout=0.1),
        # T5 pre-trains with Adafactor at 1/sqrt(max(step, 10^4)); qkv has no Adafactor (docs/DEVIATIONS.md)
        train=TrainConfig(batch_size=128, seq_len=512, max_steps=524_288, lr=1e-3, min_lr=1e-5, warmup_steps=10_000,
                          weight_decay=0.0),
        data=DataConfig(vocab_size=32128),
    )


@PRESETS.register("vaswani-base")
def vaswani_base() -> RunConfig:
    """The original Transformer base (Vaswani et al. 2017): 6+6 Post-LN layers, 512 wide, sinusoidal, ReLU, Noam."""
    return RunConfig(
        model=ModelConfig(arch="encoder-decoder", vocab_size=37000, d_model=512, n_heads=8, n_layers=6, d_ff=2048,
                          max_seq_len=256, positional="sinusoidal", norm="layernorm", norm_placement="post",
                          activation="relu", dropout=0.1, tie_embeddings=True, embed_scale=True, init="xavier"),
        # §5.3: Adam b1 0.9, b2 0.98, eps 1e-9, lrate = d^-0.5 min(s^-0.5, s 4000^-1.5); §5.4 label smoothing 0.1;
        # 100k steps of ~25k source + 25k target tokens (here 192 pairs of up to 128 tokens)
        train=TrainConfig(batch_size=192, seq_len=128, max_steps=100_000, lr=1.0, schedule="noam", warmup_steps=4000,
                          optimizer="adam", beta1=0.9, beta2=0.98, eps=1e-9, weight_decay=0.0, grad_clip=0.0,
                          label_smoothing=0.1),
        data=DataConfig(vocab_size=37000),
    )


@PRESETS.register("folio")
def folio() -> RunConfig:
    """vaswani-base reduced for 2 CPU cores: modern -> First Folio spelling, 2,000 updates (docs/tasks.md)."""
    # The paper's model (Post-LN, sinusoidal, ReLU, tied embeddings x sqrt(D), label smoothing 0.1) at the size
    # 2 CPU cores train in minutes: 128 wide, 2 + 2 layers, batches of 32 line pairs, no dropout (less than one
    # epoch); a 2,048-token BPE shared by both spellings (every training line holds both). Trained with the
    # default job's recipe instead of Adam on the Noam schedule: Muon on the hidden matrices, AdamW on the rest,
    # warmup-stable-decay (held-out chrF 84.04 against Noam's 82.24 in the same time; docs/recipe.md). The
    # 600 s cap keeps a loaded machine's run in minutes. docs/DEVIATIONS.md "Modern -> First Folio".
    base = vaswani_base()
    return RunConfig(
        model=dataclasses.replace(base.model, vocab_size=2048, d_model=128, n_heads=4, n_layers=2, d_ff=512,
                                  max_seq_len=64, dropout=0.0),
        train=dataclasses.replace(base.train, batch_size=32, seq_len=64, max_steps=2000, max_time=600.0,
                                  **RECIPE, warmup_steps=30, eval_batches=8, log_every=10),
        data=DataConfig(vocab_size=2048, split="folio", seq2seq_task="folio"),
    )
