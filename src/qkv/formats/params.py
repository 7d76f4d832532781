"""Parameters between the two engines: a torch model's named_parameters <-> a NumPy dict with the same keys.

The only module in src/ that imports both torch and the reference engine's conventions. Tied weights
appear once (named_parameters dedupes them), so the reference engine sees `tok_emb.weight` and no
`lm_head.weight`, and its gradient for the shared tensor is the sum of both uses.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from qkv.errors import QkvError
from qkv.models.build import architecture_of
from qkv.config import TrainConfig
from qkv.models import build_model
from qkv.nn.moe import aux_loss
from qkv.ref.model import loss_and_grads
from qkv.ref.optim import OPTIMIZERS


def to_numpy(model: nn.Module, dtype=np.float64) -> dict[str, np.ndarray]:
    """{name: a float64 copy of the parameter}, in named_parameters order."""
    return {name: p.detach().cpu().to(torch.float64).numpy().astype(dtype, copy=True)
            for name, p in model.named_parameters()}


def grads_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """{name: .grad as float64} for every parameter that has one."""
    return {name: p.grad.detach().cpu().to(torch.float64).numpy().copy()
            for name, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def load_numpy(model: nn.Module, params: dict[str, np.ndarray]) -> nn.Module:
    """Copy `params` into the model's parameters in place (keeping each parameter's dtype and device).
    The keys must be exactly the model's parameter names."""
    names = dict(model.named_parameters())
    missing, unknown = sorted(set(names) - set(params)), sorted(set(params) - set(names))
    if missing or unknown:
        raise QkvError(f"parameter names differ: missing {missing[:5]}, unknown {unknown[:5]}")
    for name, p in names.items():
        value = np.asarray(params[name])
        if value.shape != tuple(p.shape):
            raise QkvError(f"parameter {name}: shape {value.shape} does not match the model's {tuple(p.shape)}")
        p.copy_(torch.from_numpy(value).to(dtype=p.dtype, device=p.device))
    return model


# ---- the two engines side by side (tests and `qkv verify`, claim 12) ------------------------------

def torch_forward(model: nn.Module, inputs, attention_mask=None):
    """Call a model of any family with NumPy inputs: `inputs` is the ids array or a tuple (ids,),
    (ids, token_type_ids) for an encoder, (src_ids, tgt_ids) for an encoder-decoder, whose attention_mask
    is None or the pair (src_mask, tgt_mask); the same convention as qkv.ref.loss_and_grads."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    tensor = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    tensors = [tensor(a) for a in inputs]
    if architecture_of(model).prompt == "source":  # (src, tgt, src_mask, tgt_mask)
        masks = attention_mask if attention_mask is not None else (None, None)
        return model(*tensors, *(tensor(m) for m in masks))
    return model(tensors[0], tensor(attention_mask), *tensors[1:])  # (ids, mask[, token_type_ids])


def torch_loss_and_grads(model: nn.Module, input_ids, targets: np.ndarray, *,
                         attention_mask=None, label_smoothing: float = 0.0, aux_weight: float = 0.0):
    """The torch engine's (loss, {name: grad}, logits) by autograd, in the model's dtype. Any family:
    logits (..., K) against targets (...), plus aux_weight times the MoE load-balancing losses."""
    model.zero_grad(set_to_none=True)
    logits = torch_forward(model, input_ids, attention_mask)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).flatten(),
                                             ignore_index=-100, label_smoothing=label_smoothing)
    if aux_weight:
        loss = loss + aux_weight * aux_loss(model)
    loss.backward()
    return loss.item(), grads_to_numpy(model), logits.detach().numpy()


def torch_adamw(model: nn.Module, tc) -> torch.optim.Optimizer:
    """torch.optim.AdamW with decay on >= 2-D parameters only (as qkv.train.optim.adamw)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)


def randomize(model: nn.Module, seed: int, std: float = 0.3) -> dict[str, np.ndarray]:
    """Replace every parameter by N(0, std) (norm gains 1 + N(0, std)): far from init, so every path
    matters; returns the float64 NumPy copy."""
    rng = np.random.default_rng(seed)
    params = {name: rng.normal(scale=std, size=p.shape) + (1.0 if "norm" in name and name.endswith("weight") else 0.0)
              for name, p in model.named_parameters()}
    load_numpy(model, params)
    for name, buffer in model.named_buffers():  # an MoE's choosing bias (qkv.nn.moe): state the engines share
        if name.endswith("router_bias"):
            params[name] = rng.uniform(0.0, std, size=buffer.shape)
            buffer.copy_(torch.from_numpy(params[name]))
    return params


def example_batch(cfg, rng: np.random.Generator, batch: int, seq: int, padded: bool):
    """(inputs, attention_mask, targets) for cfg's family, in the convention of torch_forward: a causal LM
    batch for decoders, (ids, types) with hidden-state (class index < D), MLM or class targets for encoders,
    (src, tgt) for encoder-decoders. `padded` left-pads row 0 by two (every sequence of the batch)."""
    mask = None
    if padded:
        mask = np.ones((batch, seq), dtype=np.int64)
        mask[0, :2] = 0  # left padding, the way generation batches prompts
    ids = rng.integers(0, cfg.vocab_size, (batch, seq))
    if cfg.arch == "encoder-decoder":
        tgt, targets = rng.integers(0, cfg.vocab_size, (2, batch, seq))
        targets = targets if mask is None else np.where(mask == 1, targets, -100)
        return (ids, tgt), (None if mask is None else (mask, mask)), targets
    if cfg.arch == "encoder":
        inputs = (ids, rng.integers(0, cfg.type_vocab_size, (batch, seq))) if cfg.type_vocab_size else (ids,)
        if cfg.head == "classifier":
            return inputs, mask, rng.integers(0, cfg.n_classes, batch)
        width = cfg.vocab_size if cfg.head == "mlm" else cfg.d_model  # bare: a CE loss on the hidden states
        targets = rng.integers(0, width, (batch, seq))
        return inputs, mask, targets if mask is None else np.where(mask == 1, targets, -100)
    targets = rng.integers(0, cfg.vocab_size, (batch, seq))
    return ids, mask, targets if mask is None else np.where(mask == 1, targets, -100)


def compare_engines(cfg, *, seed: int = 0, batch: int = 2, seq: int = 5, steps: int = 10, padded: bool = False,
                    aux_weight: float = 0.0) -> dict:
    """Claim 12 for a whole model of any family: build cfg in torch float64 with random weights, and report
    the max abs difference between the engines in logits, loss (CE + aux_weight * the MoE balance loss),
    every parameter gradient, and after `steps` AdamW steps (TrainConfig defaults, lr 1e-2) the per-step
    losses and every parameter."""
    torch.manual_seed(seed)
    model = build_model(cfg).double()
    params = randomize(model, seed)
    ids, mask, targets = example_batch(cfg, np.random.default_rng(seed + 1), batch, seq, padded)
    loss_t, grads_t, logits_t = torch_loss_and_grads(model, ids, targets, attention_mask=mask, aux_weight=aux_weight)
    loss_r, grads_r, logits_r = loss_and_grads(params, cfg, ids, targets, attention_mask=mask, aux_weight=aux_weight)
    report = {"logits": float(np.abs(logits_t - logits_r).max()), "loss": abs(loss_t - loss_r),
              "grads": max(float(np.abs(grads_t[n] - grads_r[n]).max()) for n in grads_t),
              "grad_names_equal": set(grads_t) == set(grads_r) - {n for n, _ in model.named_buffers()}}
    tc = TrainConfig(lr=1e-2)
    optimizer_t, optimizer_r = torch_adamw(model, tc), OPTIMIZERS.get("adamw")(tc)
    losses = []
    for _ in range(steps):
        loss_t, _, _ = torch_loss_and_grads(model, ids, targets, attention_mask=mask, aux_weight=aux_weight)
        optimizer_t.step()
        loss_r, grads_r, _ = loss_and_grads(params, cfg, ids, targets, attention_mask=mask, aux_weight=aux_weight)
        optimizer_r.step(params, grads_r, tc.lr)
        losses.append(abs(loss_t - loss_r))
    after = to_numpy(model)
    report["step_losses"] = max(losses)
    report["params_after_steps"] = max(float(np.abs(after[n] - params[n]).max()) for n in after)
    return report
