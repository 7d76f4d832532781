"""A whole-model gradient check along the gradient itself: for the loss L(theta) and g = dL/dtheta from
autograd, the central difference (L(theta + eps g) - L(theta - eps g)) / (2 eps) must equal |g|^2 (float64).
One check per model, cheap enough to run over every variant combination."""
import torch


def assert_gradient_is_the_derivative(model: torch.nn.Module, loss_of, rtol: float = 1e-6) -> None:
    """`loss_of(model)` -> a scalar loss; the model in float64, dropout off."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_of(model), params)
    for p, g in zip(params, grads):
        assert torch.isfinite(g).all()
    norm2 = sum(float((g * g).sum()) for g in grads)
    assert norm2 > 0
    eps = 1e-7 / norm2 ** 0.5  # a step of 1e-7 in parameter space (a sandwich norm of a small sublayer output
    # curves sharply: at 1e-5 its truncation error reaches 3e-4)

    def shifted(sign: float) -> float:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(sign * eps * g)
            value = float(loss_of(model))
            for p, g in zip(params, grads):
                p.sub_(sign * eps * g)
        return value

    slope = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    assert abs(slope - norm2) <= rtol * norm2, (slope, norm2)
