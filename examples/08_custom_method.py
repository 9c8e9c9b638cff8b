"""A credit-assignment rule of your own: feedback alignment, written outside torchloom, trained by train().

Feedback alignment (Lillicrap et al. 2016) carries the error back through fixed random matrices ``B_i``
instead of the transposed weights ``W_iᵀ``; each layer's weight gradient stays ``gzᵀ x``. Subclassing
``torchloom.Backprop`` and overriding ``backward`` is all it takes: the rule gets the optimizer,
validation and metrics, observers, NaN/Inf guards, checkpoints with exact resume (its feedback
matrices are saved with them), precision, data-parallel training and the CUDA device path.

Run: python examples/08_custom_method.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from sklearn.datasets import load_digits

import torchloom
from torchloom import Checkpoint, Dense, Network, TrainingConfig


class FeedbackAlignment(torchloom.Backprop):
    """Backprop's machinery, with fixed random feedback ``B_i`` (the weight's shape, seeded) in place
    of ``W_i`` in each Dense layer's input gradient ``gz · W_i``."""

    name = "custom_feedback_alignment"  # (torchloom has its own: method="feedback_alignment")

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def bind(self, engine) -> None:
        super().bind(engine)
        g = torch.Generator().manual_seed(self.seed)
        self.feedback = [torch.randn(w.shape, generator=g, dtype=w.dtype).mul_(float(w.detach().std())).to(self.device)
                         for w in (layer.weight for layer in self.model.layers)]

    def backward(self, grad_out, saved):
        """Parameter gradients from the output's loss gradient, layer by layer from the top: each
        layer's own backward, shown ``B_i`` as its weight (``DenseSaved`` is a NamedTuple)."""
        grads: list[torch.Tensor] = []
        g = grad_out
        for i in range(len(self.model.layers) - 1, -1, -1):
            fixed = saved[i]._replace(weight=self.feedback[i])
            g, param_grads = self.model.layers[i].backward_saved(g, fixed, needs_input_grad=i > 0)
            grads[:0] = param_grads
        return grads

    def state_dict(self) -> dict:
        return {**super().state_dict(), "feedback": list(self.feedback)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.feedback = [b.to(self.device) for b in state["feedback"]]


torchloom.register_method(FeedbackAlignment)  # TrainingConfig(method="custom_feedback_alignment") works too


def main(epochs: int = 20, verbose: bool = True) -> dict[str, float]:
    """Train digits with feedback alignment; then show that half the epochs + a resume = the whole run."""
    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)
    data, val = (x[:1500], y[:1500]), (x[1500:], y[1500:])

    def net() -> Network:
        torch.manual_seed(0)
        return Network(Dense(64, 64, "tanh"), Dense(64, 10))

    def config(**extra) -> TrainingConfig:
        return TrainingConfig(method=FeedbackAlignment(seed=1), loss_type="cross_entropy", optimizer="momentum",
                              learning_rate=0.05, batch_size=32, shuffle=True, seed=0, validation_data=val,
                              metrics=("accuracy",), verbose=2 if verbose else 0, **extra)

    whole = net()
    result = torchloom.train(whole, data, config(epochs=epochs))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fa.pt"
        half = net()
        torchloom.train(half, data, config(epochs=epochs // 2, observers=[Checkpoint(path, save_best_only=False)]))
        resumed = net()
        torchloom.train(resumed, data, config(epochs=epochs, resume_from=path))
    exact = all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    out = {"val_accuracy": result.history["val_accuracy"][-1], "resume_exact": float(exact)}
    if verbose:
        print(f"feedback alignment: val_accuracy {out['val_accuracy']:.2%}; resumed run equals the whole run: {exact}")
    return out


if __name__ == "__main__":
    main()
