"""Neural Tweening vs backprop (SGD with momentum) on scikit-learn's 8×8 digits, 64-32-10.

Prints both test accuracies, the per-layer gaps, link budgets and alignments of Tween's final step,
and the explosions it detected and whether its rate recovered afterwards.

A detection here is a step whose mean gap grew more than 10× over the previous batch's; in batch
training that mostly follows a batch whose samples were all already learned (gated, so its hidden
gaps were 0) — not a real instability. bench/RESULTS.md (section 5) measures what detection does.

Run: python examples/04_tweening.py   (needs scikit-learn; the data ships with it; ~10 s on a CPU)
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torchloom
from torchloom import Dense, Network, TrainingConfig
from torchloom import TweenConfig, TweenTrainer

EPOCHS = 16
BATCH = 16


def load(seed: int = 0):
    """Digits scaled to [0, 1]: ``(x_train [n, 64], y_train [n], x_test, y_test)``."""
    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(d.data / 16.0, d.target, test_size=0.25, random_state=seed, stratify=d.target)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    return f(x_tr), torch.tensor(y_tr), f(x_te), torch.tensor(y_te)


def accuracy(net: Network, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def main() -> dict[str, float]:
    torch.set_num_threads(1)  # a 64-32-10 network is too small to gain from threads
    x_tr, y_tr, x_te, y_te = load()

    torch.manual_seed(0)
    tween_net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    backprop_net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    backprop_net.load_state_dict(tween_net.state_dict())  # the same starting weights

    # Tween: the document's settings (base_rate 0.01, momentum 0.9, gap threshold 0.1, ...); TweenConfig's own
    # default rate (base_rate=None) would choose 0.03 at batches of 16 rows or more (docs/tweening.md).
    trainer = TweenTrainer(tween_net, TweenConfig(base_rate=0.01, loss_type="cross_entropy"))  # softmax cross-entropy
    tween = trainer.fit((x_tr, y_tr), epochs=EPOCHS, batch_size=BATCH)

    # Backprop: SGD with momentum 0.9 at the same rate, cross-entropy on the same batches.
    batches = [(x_tr[i : i + BATCH], y_tr[i : i + BATCH]) for i in range(0, len(x_tr), BATCH)]
    config = TrainingConfig(epochs=EPOCHS, learning_rate=0.01, loss_type="cross_entropy", optimizer="momentum", verbose=False)
    backprop = torchloom.train(backprop_net, batches, config)

    acc_t, acc_b = accuracy(tween_net, x_te, y_te), accuracy(backprop_net, x_te, y_te)
    print(f"{'method':<22}{'test accuracy':>14}{'final epoch loss':>18}{'time':>8}")
    print(f"{'Tween':<22}{acc_t:>14.2%}{tween.final_loss:>18.4f}{tween.total_time:>7.1f}s")
    print(f"{'SGD + momentum 0.9':<22}{acc_b:>14.2%}{backprop.final_loss:>18.4f}{backprop.total_time:>7.1f}s")

    st = trainer.state
    print(f"\nTween, final step ({st.steps} steps of {BATCH} samples):")
    print(f"{'layer':<16}{'gap':>12}{'link budget':>13}{'alignment':>11}{'depth scale':>13}{'rate':>10}")
    for i, layer in enumerate(tween_net.layers):
        scale = st.depth_scales[i]
        print(
            f"{i} {layer.loom_type}({layer.in_features}→{layer.out_features})".ljust(16)
            + f"{st.gaps[i]:>12.3e}{st.link_budgets[i]:>13.3f}{st.alignments[i]:>11.3f}"
            + f"{(scale if scale is not None else float('nan')):>13.3f}{st.layer_rates[i]:>10.5f}"
        )
    print(f"samples that still gave a gradient in the last batch: {int(st.active.sum())}/{st.active.numel()}")

    # Explosions: the steps where explosion_count went up, and whether the rate came back to base_rate.
    steps = [k for k in range(len(st.explosion_history)) if st.explosion_history[k] > (st.explosion_history[k - 1] if k else 0)]
    base = trainer.config.base_rate
    print(f"\nexplosions detected: {st.explosion_count}" + (f" (at steps {steps[:10]}{' ...' if len(steps) > 10 else ''})" if steps else ""))
    for k in steps[:10]:
        back = next((j for j in range(k + 1, len(st.rate_history)) if st.rate_history[j] >= base), None)
        cut = st.rate_history[k]
        print(f"  step {k}: rate cut to {cut:.5f}, " + (f"back at base_rate {base} after {back - k} steps" if back is not None else "not back at base_rate by the end"))
    print(f"adaptive rate at the end: {st.adaptive_rate:.5f} (base_rate {base})")
    return {"tween": acc_t, "backprop": acc_b, "explosions": float(st.explosion_count)}


if __name__ == "__main__":
    main()
