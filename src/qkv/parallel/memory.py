"""Activation (gradient) checkpointing, applied to a finished model from outside (note 000 LLM §6.2 item 4:
"只存储部分层的激活值，在反向传播时重新计算其他激活值"; DESIGN.md: wrappers never live in model code).

Each Transformer block keeps only its input during the forward; its internal activations (attention
projections, softmax statistics, FFN hidden states: the O(L T D + L T F) of LLM §5.3) are recomputed from that
input during the backward, block by block. Cost: one extra forward of every block (about +1/3 of a training
step's FLOPs, since backward ~ 2x forward); saving: all activations inside the blocks but one block's at a time.

Non-reentrant torch.utils.checkpoint: it works with inputs that need no gradient, with keyword arguments and
with tensors that leave the block by other routes (the MoE aux loss); dropout masks are replayed exactly
because the RNG state is saved and restored around the recompute.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from qkv.nn.block import Block
from qkv.nn.fastpath import is_dtensor


# the fused attention kernels: their outputs are (B, H, T, Dh) + softmax statistics (B, H, T), as small as
# the block input, and recomputing them is the most expensive part of the recompute
ATTENTION_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name)}


def apply_activation_checkpointing(model: nn.Module, *, save_attention: bool = False) -> int:
    """Make every Block of `model` recompute its activations in the backward; returns how many were wrapped.
    `save_attention` keeps the fused attention kernels' outputs (selective checkpointing, as torchtitan's
    "op" policy): the recompute then redoes the projections, the FFN and the cheap element-wise ops only.
    Parameter names are unchanged (the forward is replaced on the instance, no wrapper module), so
    checkpoints and conversions see the same model."""
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for block in blocks:
        if not getattr(block, "activation_checkpointing", False):
            block.forward = functools.partial(_checkpointed, block, block.forward, save_attention)
            block.activation_checkpointing = True
    return len(blocks)


def _save_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(block: Block, forward, save_attention: bool, *args, **kwargs):
    # only while training with autograd: generation (no_grad, KV cache updated in place) runs plainly
    if not (block.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if save_attention:
        context = functools.partial(create_selective_checkpoint_contexts, _save_attention_policy)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the weights, their gradients and the optimizer's per-parameter states:
    a sharded (DTensor) tensor counts its local shard, a pipeline's meta parameter nothing, a ZeRO-1
    optimizer its own partition; scalar step counters are left out (qkv calc counts them as 0)."""
    def size(tensor) -> int:
        tensor = tensor.to_local() if is_dtensor(tensor) else tensor
        return 0 if tensor.is_meta else tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps this rank's partition
    return {"weights": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer_states": sum(size(value) for state in inner.state.values() for value in state.values()
                                    if torch.is_tensor(value) and value.dim() > 0)}
