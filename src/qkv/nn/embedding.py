"""The embedding equation of all three families, written once (note 000 LLM §2.1; note 000 §3, §18):

    H0 = Dropout(Norm_emb(P(E[x] * s + T[type])))

E[x] = one-hot(x) W_E, the token embedding (W_E (V, D)); s = sqrt(D) with embed_scale (Vaswani et al.
§3.4), else 1; T[type] the token-type (segment) rows (BERT; none elsewhere); P the positional encoding's
`embed` hook (adds an absolute table, or the identity for relative and rotary encodings); Norm_emb the
embedding norm (BERT) or the identity. The decoder-only model has s = 1, no types and no norm: H0 = E[x] + P.

A decoder may add a hashed bigram embedding to E[x] (model.bigram_vocab = N > 0; modded-nanogpt's bigram
hash embedding, 2026, after Chen et al. 2015's hashing trick): H0 = E[x_t] + E_2[h(x_{t-1}, x_t)] + P, with E_2
an (N, D) table that starts at zero and h a fixed hash of the token pair into rows 0..N-2; row N-1 stands for
"no previous token" (the first token of a sequence, of a left-padded row, or of a window).

`Embeddings` is a mixin rather than a submodule so the parameters keep their names on the model itself
(tok_emb.weight, type_emb.weight, embed_norm.*, positional.*): checkpoints, Hugging Face conversion and the
reference engine's names stay the same for every family.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.nn.grouped import dequantize_grouped
from qkv.nn.positional import Positional
from qkv.nn.quant import QuantLinear, dequantize_int4, dequantize_int8, unpack_nibbles


class Embeddings(nn.Module):
    tok_emb: nn.Embedding
    positional: Positional

    def set_embeddings(self, tok_emb: nn.Embedding, positional: Positional, dropout: float, *,
                       type_emb: nn.Embedding | None = None, embed_norm: nn.Module | None = None,
                       embed_scale: bool = False, bigram_emb: nn.Embedding | None = None) -> None:
        """Register the embedding's modules on the model, under the names every engine and format uses."""
        self.tok_emb = tok_emb  # W_E (V, D)
        self.bigram_emb = bigram_emb  # E_2 (N, D), rows h(x_{t-1}, x_t), or None
        self.type_emb = type_emb  # token types (segments) (type_vocab_size, D), or None
        self.positional = positional
        self.embed_norm = embed_norm if embed_norm is not None else nn.Identity()
        self.embed_scale = math.sqrt(tok_emb.embedding_dim) if embed_scale else 1.0
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0: no dropout kernel at all

    def embed(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None, *,
              previous: Tensor | None = None) -> Tensor:
        """(B, T) ids at (B, T) positions -> H0 (B, T, D). `previous` (B, T): each token's previous token
        for the bigram table, -1 for none (default: the one before it in the row, none for the first)."""
        x = self.tok_emb(input_ids)  # E[x]   (B, T, D)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.bigram_emb is not None:  # + E_2[h(x_{t-1}, x_t)]
            previous = previous if previous is not None else previous_tokens(input_ids)
            x = x + self.bigram_emb(bigram_rows(previous, input_ids, self.bigram_emb.num_embeddings))
        if self.type_emb is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.type_emb(types)
        return self.dropout(self.embed_norm(self.positional.embed(x, positions)))  # (B, T, D)


class QuantEmbedding(nn.Module):
    """E[x] looked up in a quantized layer's blocks: a GGUF file's table as shipped (qkv.formats.gguf). Each row
    looked up is dequantized, s q + m, exactly the row the table dequantizes to; the table is never held in
    float (Gemma 3's 262,144 x 640 in fp32 would be 671 MB beside its 178 MB of Q8_0 blocks; Llama 3.1 8B's
    128,256 x 4,096 2.1 GB). `blocks`: the output head where the table is tied to it (W_out = W_E, note 003: one
    vocabulary matrix; SmolLM2's and Gemma 3's Q8_0), else a layer of the table's own, never multiplied. Held
    as a plain attribute, not a submodule: the model holds a tied head as lm_head, and a table's own blocks are
    no layer that runs (nor one the compiled step prepares kernels for); a shipped model stays on the CPU.
    `dtype`: the rows' (the model's activations', set by qkv.generate.weights.cast_unquantized)."""

    def __init__(self, blocks: QuantLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        object.__setattr__(self, "blocks", blocks)
        self.num_embeddings, self.embedding_dim, self.dtype = blocks.out_features, blocks.in_features, dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.codes.device

    def forward(self, input_ids: Tensor) -> Tensor:  # (...) ids -> (..., D)
        return quantized_rows(self.blocks, input_ids.reshape(-1)).to(self.dtype).view(*input_ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.blocks.kind} blocks"


def quantized_rows(layer: QuantLinear, ids: Tensor) -> Tensor:
    """Rows `ids` (M,) of a quantized layer's W (out, in), dequantized to fp32 (M, in)."""
    scale, low = layer.scale[ids], None if layer.low is None else layer.low[ids]
    if layer.kind == "int8g":  # codes held group by group (G, out, g)
        return dequantize_grouped(layer.codes[:, ids].transpose(0, 1).reshape(len(ids), -1), scale, low)
    if layer.kind == "int4":
        return dequantize_int4(unpack_nibbles(layer.codes[ids]), scale, low)
    return dequantize_int8(layer.codes[ids], scale)


def activations_of(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device a model's activations take: its embedding table's (a QuantEmbedding's rows')."""
    table = model.tok_emb
    if isinstance(table, QuantEmbedding):
        return table.dtype, table.device
    return table.weight.dtype, table.weight.device


BIGRAM_MULTIPLIERS = (36313, 27191)  # modded-nanogpt's: spread (current, previous) over the int range


def bigram_rows(previous: Tensor, current: Tensor, rows: int) -> Tensor:
    """h(p, c) = (36313 c XOR 27191 p) mod (N - 1) for each pair, N - 1 where p = -1 (no previous token)."""
    a, b = BIGRAM_MULTIPLIERS
    hashed = torch.bitwise_xor(a * current, b * previous.clamp(min=0)) % (rows - 1)
    return torch.where(previous < 0, rows - 1, hashed)


def previous_tokens(input_ids: Tensor, attention_mask: Tensor | None = None, last: Tensor | None = None) -> Tensor:
    """(B, T) the token before each one, -1 where there is none: column 0 takes `last` (B,) (the last token
    a cache has seen; -1 = none), and a token whose previous column is padding has none."""
    previous = input_ids.roll(1, dims=1)
    previous[:, 0] = last if last is not None else -1
    if attention_mask is not None:
        real = attention_mask.bool().roll(1, dims=1)
        real[:, 0] = True
        previous = torch.where(real, previous, -1)
    return previous


def last_tokens(input_ids: Tensor, attention_mask: Tensor | None, last: Tensor) -> Tensor:
    """(B,) each row's last real token of this call, or `last` where the call holds none."""
    if attention_mask is None:
        return input_ids[:, -1]
    real = attention_mask.bool()
    index = (real.long() * torch.arange(1, real.shape[1] + 1, device=real.device)).argmax(-1)  # last real column
    return torch.where(real.any(-1), input_ids.gather(1, index[:, None])[:, 0], last)
