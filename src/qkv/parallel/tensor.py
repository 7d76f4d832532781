"""Tensor parallel with sequence parallel for qkv's decoder (note 000 LLM §7.2; SPEC C3).

Y = X W with W split over the tp ranks of `tp_mesh` (note 000 LLM §7.2 "将矩阵乘法分块计算"):

- column split (ColwiseParallel) of W^Q, W^K, W^V and of the FFN's W1 / W_gate: rank r holds H/tp query
  heads, Hkv/tp key/value heads and F/tp hidden units, and computes its slice of the output;
- row split (RowwiseParallel) of W^O and W2 / W_down: rank r multiplies its slice of the input and the
  partial sums are reduce-scattered over the sequence;
- sequence parallel (note 000 LLM §7.2 "将序列维度分到多个GPU"): between those matmuls the residual
  stream, the norms and the residual dropout hold T/tp positions per rank; an all-gather over the sequence
  enters each attention / FFN and a reduce-scatter leaves it.

The plan follows torchtitan's for Llama, with two differences that qkv's decoder needs: the embedding
ends in an all-reduce (a replicated (B, T, D) stream, so the positional encoding and the embedding dropout
see whole positions) and the stream is split over the sequence at the first block's input. The LM head's
logits stay split over the vocabulary (B, T, V/tp) into a vocabulary-parallel cross-entropy
(qkv.nn.linear_cross_entropy.vocab_parallel_loss, torchtitan's loss_parallel), except in a pipeline, whose
last stage hands whole logits to its loss.
With tied embeddings W_E and W_out are one (V, D) tensor split over the vocabulary in both uses.

Model code stays single-device: `apply` rewrites a finished model from outside (parameters become
DTensors, each attention module is told its local head counts), as torchtitan's `parallelize_llama` does.
"""
from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.nn.positional import Learned
from qkv.nn.residual import RESIDUALS

# encodings whose parameters or biases work per head on whole positions: supported as they are (none,
# sinusoidal, rope: no parameters; learned: a replicated table; alibi: each rank keeps its heads' slopes)
SUPPORTED_POSITIONALS = ("none", "sinusoidal", "learned", "rope", "alibi")


def validate(cfg: ModelConfig, tp: int) -> None:
    """QkvError unless `cfg` can be split over `tp` ranks: H, Hkv and F must divide (a rank holds whole heads;
    V need not, DTensor gives the last ranks one row fewer)."""
    if tp == 1:
        return
    if cfg.arch != "decoder":
        raise QkvError(f"parallel.tp={tp}: tensor parallel supports model.arch='decoder' only, not {cfg.arch!r}")
    if cfg.moe_experts:
        raise QkvError(f"parallel.tp={tp}: tensor parallel does not support mixture-of-experts FFNs "
                       f"(model.moe_experts={cfg.moe_experts}); use model.moe_experts=0")
    if cfg.mla_kv_rank:
        raise QkvError(f"parallel.tp={tp}: tensor parallel does not split latent attention's projections "
                       f"(model.mla_kv_rank={cfg.mla_kv_rank}); use model.mla_kv_rank=0")
    if cfg.positional not in SUPPORTED_POSITIONALS:
        raise QkvError(f"parallel.tp={tp}: model.positional={cfg.positional!r} reads its own parameters inside "
                       f"every attention layer, which tensor parallel does not split; use one of "
                       f"{', '.join(SUPPORTED_POSITIONALS)}")
    for name, size in (("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.kv_heads),
                       ("model.d_ff", cfg.d_ff)):
        if size % tp:
            raise QkvError(f"parallel.tp={tp} must divide {name}={size}: each rank holds {name.split('.')[-1]} / tp")


def apply(model: nn.Module, tp_mesh: DeviceMesh, model_cfg: ModelConfig, *, split_logits: bool = True) -> nn.Module:
    """Split `model` (a DecoderLM built from `model_cfg`, same weights on every rank) over the 1-D `tp_mesh`.

    Every parameter becomes a DTensor on `tp_mesh` (sharded or replicated), so the optimizer and gradient
    clipping see one kind of tensor. `split_logits`: the head returns its (B, T, V/tp) slice as a DTensor
    sharded over V (for `vocab_parallel_loss`), else gathered (B, T, V) logits. Returns `model`, changed in place."""
    tp = tp_mesh.size()
    validate(model_cfg, tp)
    if tp == 1:
        return model
    tied = model.lm_head.weight is model.tok_emb.weight
    tables = {"bigram_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
              } if model.bigram_emb is not None else {}  # (N, D) split over N, as W_E
    parallelize_module(model, tp_mesh, {
        # (V, D) split over V; each rank looks up the ids in its slice, the partial rows are all-reduced
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()), **tables,
        # (V, D) split over V: gather the T/tp positions, compute V/tp logits (kept split, or gathered)
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if split_logits else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    if tied:  # parallelize_module gave each use its own DTensor; both are Shard(0) of the same (V, D)
        model.lm_head.weight = model.tok_emb.weight
    if not isinstance(model.final_norm, nn.Identity):
        parallelize_module(model.final_norm, tp_mesh, SequenceParallel(use_local_output=True))
    # the replicated embedding stream is split over the sequence at the first block (a local slice)
    parallelize_module(model.blocks[0], tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None), use_local_output=True))
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(model_cfg))
        block.attn.n_heads //= tp  # local heads: H/tp queries, Hkv/tp keys and values per rank
        block.attn.n_kv_heads //= tp
    localise_positional(model.positional, tp_mesh)
    return model


def sequence_parallel_norm(cfg: ModelConfig) -> SequenceParallel | dict:
    """A norm over (B, T/tp, D) with a replicated gain; a sandwich sublayer's NormPair has two of them.
    Local outputs: the residual stream stays a plain tensor for every placement (post-norm puts a norm's
    output back into the stream)."""
    style = SequenceParallel(use_local_output=True)
    return {"inner": style, "outer": style} if RESIDUALS.get(cfg.norm_placement).paired else style


def block_plan(cfg: ModelConfig) -> dict:
    """One block's plan. Its inputs are (x, ctx, cache): only x has a layout."""
    gather = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                desired_input_layouts=(Replicate(), None, None))  # all-gather (B, T, D)
    gather_ffn = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    norm = sequence_parallel_norm(cfg)
    plan = {
        "attn_norm": norm, "ffn_norm": norm,
        "attn": gather,
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to (B, T/tp, D)
        "ffn": gather_ffn,
        "ffn.up_proj": ColwiseParallel(),
        "ffn.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if cfg.ffn == "glu":
        plan["ffn.gate_proj"] = ColwiseParallel()
    return plan


class LocalTable(Learned):
    """The learned table P under tensor parallel: a replicated DTensor parameter whose lookup reads the
    rank's local copy, since positions and the embedding stream are plain tensors."""

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return Learned.embed(SimpleNamespace(weight=self.weight.to_local()), x, positions)


def localise_positional(positional: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Adapt the shared positional module to the rank's heads and to DTensor parameters."""
    if isinstance(positional, Learned):
        positional.weight = nn.Parameter(distribute_tensor(positional.weight.data, tp_mesh, [Replicate()]))
        positional.__class__ = LocalTable
    if hasattr(positional, "slopes"):  # ALiBi: the slopes of this rank's contiguous H/tp heads
        rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
        positional.slopes = positional.slopes.chunk(tp)[rank].clone()
