"""Training with no autograd: the reference engine's optimizers, clipping, schedule and loop against
torch.optim and a plain torch float64 loop written here."""
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import TrainConfig
from qkv.data.dataset import Batches
from qkv.formats.params import to_numpy
from qkv.ref.optim import OPTIMIZERS
from qkv.ref.train import learning_rate, train_ref, train_step
from qkv.schedules import SCHEDULES

SRC = Path(__file__).resolve().parents[2] / "src"


def torch_loop_lr(step, tc, total):
    """The schedule the torch loop (qkv.train.loop) uses: qkv.schedules, shared by both engines."""
    return SCHEDULES.get(tc.schedule)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps, total=total, d_model=32)


def test_tiny_preset_trains_like_torch_for_20_steps():
    cfg = qkv.presets.get("tiny")
    torch.manual_seed(cfg.train.seed)
    model = qkv.build_model(cfg.model).double()
    params = to_numpy(model)
    period = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 40)
    tokens = np.tile(period, 100)  # a learnable stream: it repeats every 40 tokens
    draw = Batches(tokens, cfg.train.seq_len, cfg.train.batch_size, seed=1)
    batches = [draw.next() for _ in range(20)]

    losses = train_ref(params, cfg, batches, steps=20)

    tc = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    expected, clipped = [], 0
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = torch_loop_lr(step, tc, 20)
        loss = F.cross_entropy(model(torch.from_numpy(x)).flatten(0, 1), torch.from_numpy(y).flatten())
        loss.backward()
        clipped += torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip).item() > tc.grad_clip
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-8)
    assert losses[-1] < losses[0] - 0.5  # it learns
    final = to_numpy(model)
    assert max(np.abs(final[n] - params[n]).max() for n in params) < 1e-8
    assert clipped > 0  # the clipping branch ran


def test_cosine_schedule_endpoints():
    """Warmup lr * (step + 1) / warmup, peak lr at step warmup, min_lr at the last step total - 1."""
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert learning_rate(tc, 0, 100, 32) == pytest.approx(1e-4)
    assert learning_rate(tc, 9, 100, 32) == pytest.approx(1e-3)
    assert learning_rate(tc, 10, 100, 32) == pytest.approx(1e-3)
    assert learning_rate(tc, 55, 100, 32) == pytest.approx(1e-4 + 0.45e-3 * (1 + math.cos(math.pi * 45 / 89)))
    assert learning_rate(tc, 99, 100, 32) == pytest.approx(1e-4)


def test_accumulation_equals_the_large_batch():
    """LLM §10.4: the mean over k equal micro-batches of the micro-batch gradient is the batch gradient."""
    cfg = qkv.ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=8)
    params = to_numpy(qkv.build_model(cfg).double())
    x, y = np.random.default_rng(0).integers(0, 11, (2, 4, 5))
    results = []
    for k in (1, 2):
        p = {n: v.copy() for n, v in params.items()}
        tc = TrainConfig(accumulation=k, batch_size=4)
        loss, norm = train_step(p, cfg, tc, OPTIMIZERS.get("adamw")(tc), x, y, lr=1e-2)
        results.append((loss, norm, p))
    assert abs(results[0][0] - results[1][0]) < 1e-14 and abs(results[0][1] - results[1][1]) < 1e-14
    assert max(np.abs(results[0][2][n] - results[1][2][n]).max() for n in params) < 1e-14


def test_seq2seq_batches_train_like_torch_with_accumulation():
    """train_ref on the seq2seq objective's 5-tuple batches (src, src_mask, tgt_in, tgt_mask, labels), padded
    sources, accumulation 2: the same losses and weights as torch autograd + torch.optim.AdamW, 5 steps."""
    model_cfg = qkv.ModelConfig(arch="encoder-decoder", vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12,
                                max_seq_len=8, positional="t5")
    cfg = replace(qkv.presets.get("tiny"), model=model_cfg,
                  train=TrainConfig(batch_size=4, accumulation=2, lr=1e-2, warmup_steps=2, grad_clip=0.5))
    torch.manual_seed(0)
    model = qkv.build_model(model_cfg).double()
    params = to_numpy(model)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(5):
        src, tgt, labels = rng.integers(0, 11, (3, 4, 5))
        src_mask, tgt_mask = np.ones((4, 5), dtype=np.int64), np.ones((4, 5), dtype=np.int64)
        src_mask[1, :2] = 0
        batches.append((src, src_mask, tgt, tgt_mask, np.where(rng.random((4, 5)) < 0.2, -100, labels)))

    losses = train_ref(params, cfg, batches, steps=5)

    tc = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    expected = []
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = SCHEDULES.get(tc.schedule)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps,
                                                     total=5, d_model=8)
        total = 0.0
        for micro in zip(*(np.array_split(a, 2) for a in batch)):
            src, src_mask, tgt, tgt_mask, labels = (torch.from_numpy(a) for a in micro)
            logits = model(src, tgt, src_mask, tgt_mask)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-10)
    final = to_numpy(model)
    assert max(np.abs(final[n] - params[n]).max() for n in params) < 1e-9


def test_reference_engine_runs_without_torch():
    """qkv.ref imports numpy only: with torch made unimportable (and qkv/__init__, which builds torch
    models, bypassed), a training step and the gradient checks still run."""
    script = f"""
import sys, types, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
package = types.ModuleType("qkv"); package.__path__ = [{str(SRC / 'qkv')!r}]; sys.modules["qkv"] = package
import numpy as np
from qkv.config import RunConfig, ModelConfig, TrainConfig
from qkv.ref import train_ref, gradcheck
from qkv.ref.model import forward
cfg = RunConfig(model=ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=8),
                train=TrainConfig(warmup_steps=1))
rng = np.random.default_rng(0)
shapes = {{"tok_emb.weight": (11, 8), "positional.weight": (8, 8), "final_norm.weight": (8,), "final_norm.bias": (8,)}}
for part in ("attn_norm", "ffn_norm"):
    shapes.update({{f"blocks.0.{{part}}.weight": (8,), f"blocks.0.{{part}}.bias": (8,)}})
for proj in "qkvo":
    shapes.update({{f"blocks.0.attn.{{proj}}_proj.weight": (8, 8), f"blocks.0.attn.{{proj}}_proj.bias": (8,)}})
shapes.update({{"blocks.0.ffn.up_proj.weight": (12, 8), "blocks.0.ffn.up_proj.bias": (12,),
               "blocks.0.ffn.down_proj.weight": (8, 12), "blocks.0.ffn.down_proj.bias": (8,)}})
params = {{n: rng.normal(scale=0.3, size=s) for n, s in shapes.items()}}
batch = rng.integers(0, 11, (2, 2, 5))
losses = train_ref(params, cfg, [batch, batch, batch], 3)
assert losses[2] < losses[0], losses
assert all(c.passed for c in gradcheck.check_fd("norm_layernorm"))
assert "torch" not in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
