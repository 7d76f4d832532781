"""Claims about gradients, norms and activations: 8-14, 28, 29, 31. The hand-derived backward passes are
qkv.ref's (NumPy); every one is compared with torch autograd here as the independent oracle."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from qkv.claims.base import Result, claim, status
from qkv.analysis.record import layer_grad_norms
from qkv.config import ModelConfig
from qkv.formats.params import compare_engines
from qkv.models.build import block
from qkv.nn.ffn import GLU, MLP
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.nn.norms import LayerNorm, RMSNorm
from qkv.nn.residual import RESIDUALS, post_norm, pre_norm
from qkv.ref import gradcheck
from qkv.ref.functional import cross_entropy_forward

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.jacobian(fn, x)


@claim(8, "residual Jacobian = dF/dx + I; gradients survive L residual layers but vanish through L plain ones",
       "000 §6.3, §12.1; 003 (残差连接)")
def residual_gradient() -> Result:
    d = 16
    W = torch.randn(32, d, d, generator=_gen(), dtype=F64) * 0.5 / d ** 0.5  # contractive layers, gain 0.5
    layer = lambda x, l: torch.tanh(x @ W[l].T)  # noqa: E731  F_l(x)
    x0 = torch.randn(d, generator=_gen(1), dtype=F64)
    jump = (_jacobian(lambda x: x + layer(x, 0), x0) - _jacobian(lambda x: layer(x, 0), x0) - torch.eye(d, dtype=F64))
    measured = {"max|J(x + F) - J(F) - I|": jump.abs().max().item()}
    for L in (1, 8, 32):
        def plain(x, L=L):
            for l in range(L):
                x = layer(x, l)
            return x

        def residual(x, L=L):
            for l in range(L):
                x = x + layer(x, l)
            return x
        measured[f"||dx_L/dx_0||_2 L={L} (plain, residual)"] = [
            torch.linalg.matrix_norm(_jacobian(f, x0), ord=2).item() for f in (plain, residual)]
    plain32, res32 = measured["||dx_L/dx_0||_2 L=32 (plain, residual)"]
    measured["qkv block: max|J(pre-LN sublayer) - J(F(LN(x))) - I|"] = qkv_residual_identity()
    ok = (max(v for key, v in measured.items() if key.startswith(("max", "qkv"))) < 1e-12
          and plain32 < 1e-6 and res32 > 1.0)
    return Result(status(ok), measured, "d=16, F_l(x) = tanh(W_l x) with gain 0.5, float64, Jacobians by "
                  "autograd; the spectral norm of the product shrinks like 0.5^L without the identity path. The "
                  "identity is also checked on qkv's own block (qkv.nn.residual's pre-LN wrapper around a built "
                  "block's FFN sublayer).")


def qkv_residual_identity() -> float:
    """J(x + F(LN(x))) - J(F(LN(x))) = I for the FFN sublayer of a block built by qkv.models.build."""
    torch.manual_seed(0)
    built = block(ModelConfig(d_model=8, n_heads=2, d_ff=16)).double()
    x = torch.randn(3, 8, generator=_gen(2), dtype=F64)
    pre = RESIDUALS.get("pre").apply
    with_identity = _jacobian(lambda h: pre(h, built.ffn_norm, built.ffn), x)
    without = _jacobian(lambda h: built.ffn(built.ffn_norm(h)), x)
    eye = torch.eye(x.numel(), dtype=F64).reshape(*x.shape, *x.shape)
    return (with_identity - without - eye).abs().max().item()


@claim(9, "LayerNorm Jacobian: dx^_i/dx_j = (delta_ij - 1/d - x^_i x^_j / d) / sigma (the §12.2 form); the summary "
          "table's (I - 11^T/d)(I - x^x^T) gamma/sigma lacks the 1/d", "000 §12.2, LLM §3.3.1, LLM summary table")
def layernorm_jacobian() -> Result:
    ref = gradcheck.layernorm_jacobian()
    d, eps = 8, 1e-5
    x = torch.randn(d, generator=_gen(), dtype=F64) * 2 + 0.5
    auto = _jacobian(lambda t: F.layer_norm(t, (d,), eps=eps), x)
    sigma = (x.var(unbiased=False) + eps).sqrt()
    xhat = (x - x.mean()) / sigma
    eye = torch.eye(d, dtype=F64)
    corrected = (eye - 1.0 / d - torch.outer(xhat, xhat) / d) / sigma
    table = (eye - torch.ones(d, d, dtype=F64) / d) @ (eye - torch.outer(xhat, xhat)) / sigma
    measured = {**{f"ref {k}": v for k, v in ref.items()},
                "max|corrected - autograd|": (corrected - auto).abs().max().item(),
                "max|note table - autograd|": (table - auto).abs().max().item()}
    ok = (ref["backward_vs_fd"] < 1e-6 and ref["corrected_vs_backward"] < 1e-10
          and measured["max|corrected - autograd|"] < 1e-10 and measured["max|note table - autograd|"] > 1e-2)
    return Result(status(ok, "corrected"), measured,
                  "The §12.2 / LLM §3.3.1 form is right (it reduces to the corrected one since sum_k x^_k = 0). "
                  "The summary table's (gamma/sigma)(I - 11^T/d)(I - x^ x^T) is wrong: the correct matrix is "
                  "(gamma/sigma)(I - 11^T/d - x^ x^T / d). Checked: qkv.ref's backward, finite differences, "
                  "torch autograd of F.layer_norm (d=8, float64).")


@claim(10, "softmax cross-entropy gradient dL/dlogits = P - onehot", "000 LLM §3.1")
def softmax_ce() -> Result:
    ref = gradcheck.softmax_ce_gradient()
    logits = torch.randn(6, 7, generator=_gen(), dtype=F64, requires_grad=True)
    targets = torch.randint(0, 7, (6,), generator=_gen(1))
    F.cross_entropy(logits, targets, reduction="sum").backward()
    closed = logits.detach().softmax(-1) - F.one_hot(targets, 7)
    measured = {**{f"ref {k}": v for k, v in ref.items()}, "max|(P - onehot) - autograd| (sum)": (
        closed - logits.grad).abs().max().item()}
    return Result(status(max(measured.values()) < 1e-8), measured,
                  "For the summed loss of §3.1 the gradient is P - onehot; for the mean over N tokens that "
                  "§2.4 computes it is (P - onehot)/N (qkv.ref differentiates the mean; docs/DEVIATIONS.md).")


@claim(11, "softmax backward row rule dS = A * (dA - rowsum(A * dA))", "000 LLM §3.3.3 step 3")
def softmax_rule() -> Result:
    ref = gradcheck.softmax_row_rule()
    S = torch.randn(6, 6, generator=_gen(), dtype=F64, requires_grad=True)
    dA = torch.randn(6, 6, generator=_gen(1), dtype=F64)
    (S.softmax(-1) * dA).sum().backward()
    A = S.detach().softmax(-1)
    rule = A * (dA - (A * dA).sum(-1, keepdim=True))
    measured = {**{f"ref {k}": v for k, v in ref.items()}, "max|rule - autograd|": (rule - S.grad).abs().max().item()}
    return Result(status(max(measured.values()) < 1e-8), measured, "6 x 6 scores, float64.")


LLM_CASES = ("cross_entropy", "linear", "norm_layernorm", "activation_relu", "ffn_mlp_relu", "softmax",
             "kernel_naive_causal", "attention_mha", "embedding", "learned_positions")


@claim(12, "every hand-derived gradient of LLM §3 matches autograd", "000 LLM §3.1-§3.5")
def hand_gradients() -> Result:
    checks = [c for name in LLM_CASES if name in gradcheck.CASES.names() for c in gradcheck.check_fd(name)]
    # the LLM part's model: Post-LN, ReLU FFN, tied output layer (§1.2, §5.1), learned positions
    note_model = ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=16, max_seq_len=16,
                             norm_placement="post", activation="relu", attention="naive")
    engines = compare_engines(note_model, steps=3)
    measured = {"finite-difference checks passed": f"{sum(c.passed for c in checks)}/{len(checks)}",
                "max rel. error vs finite differences": max(c.max_rel for c in checks),
                "whole model vs torch autograd: max|grad diff|": engines["grads"],
                "logits, loss": [engines["logits"], engines["loss"]],
                "after 3 AdamW steps: max|param diff|": engines["params_after_steps"]}
    ok = all(c.passed for c in checks) and engines["grads"] < 1e-10 and engines["params_after_steps"] < 1e-8
    return Result(status(ok), measured, "qkv.ref's hand-written backward passes (CE, output layer, LayerNorm, "
                  "FFN with the ReLU mask, attention dV/dA/dS/dQ/dK, projections, embedding scatter-add) against "
                  "central finite differences, and the whole Post-LN model against the torch engine's autograd "
                  "on identical float64 weights (qkv.formats.params.compare_engines).")


@claim(13, "embedding lookup equals the one-hot matmul; its gradient is a scatter-add", "000 LLM §3.5; 003 (词嵌入)")
def embedding() -> Result:
    ref = gradcheck.embedding_scatter_add()
    weight = torch.randn(7, 5, generator=_gen(), dtype=F64, requires_grad=True)
    ids = torch.tensor([1, 3, 1, 6, 0, 1])
    upstream = torch.randn(6, 5, generator=_gen(1), dtype=F64)
    (F.embedding(ids, weight) * upstream).sum().backward()
    scatter = torch.zeros(7, 5, dtype=F64).index_add_(0, ids, upstream)
    measured = {**{f"ref {k}": v for k, v in ref.items()}, "max|autograd - index_add|": (weight.grad - scatter).abs().max().item()}
    return Result(status(max(measured.values()) < 1e-12), measured, "Repeated ids (token 1 three times) accumulate.")


@claim(14, "label smoothing: target (1 - eps) onehot + eps/K and its loss", "000 §13.3, LLM §6.3")
def label_smoothing() -> Result:
    eps, K = 0.1, 10
    logits = torch.randn(1, 6, K, generator=_gen(), dtype=F64, requires_grad=True)
    targets = torch.randint(0, K, (1, 6), generator=_gen(1))
    smooth = (1 - eps) * F.one_hot(targets, K).to(F64) + eps / K
    explicit = -(smooth * logits.log_softmax(-1)).sum(-1).mean()
    qkv_loss = cross_entropy(logits, targets, label_smoothing=eps)
    grad = torch.autograd.grad(qkv_loss, logits)[0]
    ref_loss = cross_entropy_forward(logits.detach().numpy(), targets.numpy(), label_smoothing=eps)[0]
    measured = {"|explicit - qkv loss (fp32)|": abs(explicit - qkv_loss).item(),
                "|explicit - ref loss|": abs(explicit.item() - ref_loss),
                "max|(P - y')/N - autograd of qkv loss|": ((logits.softmax(-1) - smooth) / 6 - grad).abs().max().item()}
    ok = measured["|explicit - ref loss|"] < 1e-12 and max(measured.values()) < 1e-6
    return Result(status(ok), measured, "eps=0.1, K=10: the eps/K share also goes to the true class, as in the "
                  "note and in torch's label_smoothing. qkv's training loss computes in fp32 (hence ~1e-7).")


@claim(28, "sigmoid' = sigma(1 - sigma); Swish(z) = z sigma(z); SwiGLU = (xW) * Swish(xV); GELU vs ReLU",
       "003 (sigmoid, SwiGLU, ReLU)")
def activations() -> Result:
    z = torch.linspace(-6, 6, 241, dtype=F64, requires_grad=True)
    sig = torch.sigmoid(z)
    (dsig,) = torch.autograd.grad(sig.sum(), z)
    zd = z.detach()
    glu = GLU(8, 12, activation="silu", bias=False).double()
    x = torch.randn(5, 8, generator=_gen(), dtype=F64)
    a, b = x @ glu.up_proj.weight.T, x @ glu.gate_proj.weight.T  # note 003: a = x W1, b = x W2
    note_form = (a * (b * torch.sigmoid(b))) @ glu.down_proj.weight.T  # h = a * swish(b); out = h W3
    gelu = F.gelu(zd)
    (dgelu,) = torch.autograd.grad(F.gelu(z).sum(), z)
    measured = {"max|autograd sigma' - sigma(1 - sigma)|": (dsig - sig * (1 - sig)).abs().max().item(),
                "max|F.silu - z sigma(z)|": (F.silu(zd) - zd * torch.sigmoid(zd)).abs().max().item(),
                "max|qkv GLU(silu) - note 003 SwiGLU|": (glu(x) - note_form).abs().max().item(),
                "max|GELU - z Phi(z)|": (gelu - zd * 0.5 * (1 + torch.erf(zd / 2 ** 0.5))).abs().max().item(),
                "max|GELU - ReLU| and where": [(gelu - F.relu(zd)).abs().max().item(),
                                               zd[(gelu - F.relu(zd)).abs().argmax()].item()],
                "GELU'(-1) (ReLU'(-1) = 0)": dgelu[100].item()}
    ok = max(list(measured.values())[:4]) < 1e-12 and measured["GELU'(-1) (ReLU'(-1) = 0)"] < -0.05
    return Result(status(ok), measured, "GELU = z Phi(z) is smooth, dips to -0.17 near z = -0.75 and passes "
                  "gradient for z < 0 where ReLU passes none.")


@claim(29, "RMSNorm equals LayerNorm without mean subtraction: equal when the mean is zero", "003 (RMSNorm)")
def rmsnorm() -> Result:
    d = 32
    ln, rms = LayerNorm(d, eps=1e-6, bias=True).double(), RMSNorm(d, eps=1e-6).double()
    x = torch.randn(10, d, generator=_gen(), dtype=F64) * 3 + 1.5
    centred = x - x.mean(-1, keepdim=True)
    measured = {"max|RMSNorm - LayerNorm| zero-mean rows": (rms(centred) - ln(centred)).abs().max().item(),
                "same, rows with mean ~1.5": (rms(x) - ln(x)).abs().max().item()}
    ok = measured["max|RMSNorm - LayerNorm| zero-mean rows"] < 1e-10 and measured["same, rows with mean ~1.5"] > 0.1
    return Result(status(ok), measured, "qkv's LayerNorm and RMSNorm modules, gains 1, LayerNorm's beta 0, float64.")


@claim(31, "Post-LN is LN(x + F(x)), Pre-LN x + F(LN(x)); note 002's 'Post-Norm' x + LN(F(x)) is neither; "
          "gradient norms per layer at init differ", "002 (Pre-Norm vs Post-Norm); 000 §6.1")
def norm_placement() -> Result:
    torch.manual_seed(0)
    f, norm = MLP(16, 64, activation="gelu", bias=True).double(), LayerNorm(16, eps=1e-5).double()
    x = torch.randn(4, 16, generator=_gen(), dtype=F64) * 2
    note = x + norm(f(x))
    measured = {"max|note 002 form - Post-LN|": (note - post_norm(x, norm, f)).abs().max().item(),
                "max|note 002 form - Pre-LN|": (note - pre_norm(x, norm, f)).abs().max().item()}
    for placement in ("pre", "post"):
        cfg = ModelConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=12, d_ff=128, max_seq_len=64,
                          norm_placement=placement, init="xavier", positional="sinusoidal")
        norms = np.mean([layer_grad_norms(cfg, seed=s, batch=4, seq=16) for s in range(3)], axis=0)
        measured[f"{placement}-LN grad norm per layer"] = [round(float(n), 4) for n in norms]
        measured[f"{placement}-LN last / first"] = round(float(norms[-1] / norms[0]), 3)
    ok = (min(measured["max|note 002 form - Post-LN|"], measured["max|note 002 form - Pre-LN|"]) > 0.1
          and measured["post-LN last / first"] > measured["pre-LN last / first"])
    return Result(status(ok, "corrected"), measured,
                  "Note 002 writes Post-Norm as x + LN(F(x)); the original Transformer's Post-LN is LN(x + F(x)) "
                  "(000 §6.1). Gradient norms at init (12-layer decoders, d=32, Xavier init as in Xiong et al. 2020, "
                  "sinusoidal positions, mean of 3 seeds): Pre-LN's shrink with depth (the residual stream grows, "
                  "so LN divides by more), Post-LN's do not, so its last layers take the largest updates early in "
                  "training, which Xiong et al. tie to Post-LN's need for LR warmup.")
