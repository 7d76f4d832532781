"""qkv.train.steps.MicroBatches: micro-batches weighted by their share give the gradient of the whole batch
(note 000 LLM §10.4), a short last micro-batch included; the loss returned is the batch mean."""
import dataclasses

import torch

from qkv import presets
from qkv.models import build_model
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.parallel.layout import Layout
from qkv.train.steps import MicroBatches, runner_for


def setup(accumulation: int, batch_size: int = 6):
    cfg = presets.get("tiny")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_size,
                                                            accumulation=accumulation))
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg.model, dropout=0.0)).double()
    return cfg, model


def backward(module, micro, share):
    inputs, targets = micro
    loss = cross_entropy(module(inputs), targets)
    (loss * share).backward()
    return loss.detach(), torch.zeros((), dtype=loss.dtype)


def test_micro_batches_give_the_whole_batch_gradient_and_mean_loss():
    cfg, model = setup(accumulation=3)  # micro-batches of 2 rows
    V = cfg.model.vocab_size
    inputs, targets = torch.randint(0, V, (5, 9)), torch.randint(0, V, (5, 9))  # 5 rows: 2 + 2 + 1
    runner = runner_for(model, cfg, Layout())
    assert isinstance(runner, MicroBatches) and runner.wrapped is model and runner.micro_rows == 2
    loss, aux = runner.forward_backward((inputs, targets), backward)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    whole = cross_entropy(model(inputs), targets)
    whole.backward()
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert float(aux) == 0.0


def test_clip_is_the_global_norm_and_the_full_state_is_the_model():
    cfg, model = setup(accumulation=1)
    runner = MicroBatches(model, cfg, Layout())
    V = cfg.model.vocab_size
    runner.forward_backward((torch.randint(0, V, (6, 9)), torch.randint(0, V, (6, 9))), backward)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.sqrt(sum((g ** 2).sum() for g in grads))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    norm = runner.clip(max_norm=float(expected) / 4)
    torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g / 4, rtol=1e-6, atol=1e-12)  # scaled to the max norm
    weights = runner.full_weights()  # one process: the model's own tensors, as its files hold them
    assert all(torch.equal(before[name], weights[name]) for name, p in model.named_parameters())
    assert runner.evaluator() == (model, None)
