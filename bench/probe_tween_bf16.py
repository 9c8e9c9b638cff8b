"""Where Tweening loses accuracy under ``precision="bf16-mixed"`` (issue "Every method learns", item 5).

The issue's case: a 784-4096-4096-10 ReLU network, random-normal inputs with 10 balanced random
labels (65,536 samples, memorisation: train accuracy is the measure), batch 1,024, 4 epochs; Tween
in bf16 reached 0.29 train accuracy against 0.44 in float32, where backprop matched to 4 digits.
Each variant prints its per-epoch train accuracy and Tween's watch (explosions, adaptive rate):

* ``backprop`` float32 / bf16 (the control);
* ``tween`` float32 / bf16, with the fused device step and with the torch-op step
  (``kernel_backend="reference"``), and bf16 with the explosion watch off.

Run: ``PYTHONPATH=. python bench/probe_tween_bf16.py [--samples 65536 --epochs 4 --width 4096]`` (CUDA).
"""

from __future__ import annotations

import argparse
import time

import torch

from torchloom import Dense, Network, TrainingConfig, TweenConfig, TweenTrainer, train


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 784, generator=g)
    y = torch.arange(n) % 10
    return x, y[torch.randperm(n, generator=g)]


def net(width: int) -> Network:
    torch.manual_seed(0)
    return Network(Dense(784, width, "relu"), Dense(width, width, "relu"), Dense(width, 10)).cuda()


def run(name: str, precision: str, width: int, xy, epochs: int, batch: int, backend: str | None = None, watch: bool = True) -> None:
    model = net(width)
    cfg = dict(epochs=epochs, batch_size=batch, precision=precision, verbose=0, metrics=("accuracy",), use_gpu=True,
               loss_type="cross_entropy")
    start = time.perf_counter()
    if name == "backprop":
        r = train(model, xy, TrainingConfig(optimizer="momentum", learning_rate=0.01, **cfg))
        extra = ""
    else:
        method = TweenConfig(explosion_detection=watch)
        trainer = TweenTrainer(model, method, training=TrainingConfig(method=method, **cfg))
        trainer.kernel_backend = backend
        r = trainer.fit(xy, epochs)
        st = trainer.state
        extra = f"explosions {st.explosion_count}, adaptive_rate {st.adaptive_rate:.4g}, fused {trainer.method._fused is not None}"
    acc = [round(a, 4) for a in r.history["accuracy"]]
    print(f"{name:9s} {precision:10s} backend={backend!s:9s} watch={watch!s:5s} acc {acc} loss {r.loss_history[-1]:.4f} "
          f"{time.perf_counter() - start:.1f}s {extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    xy = data(args.samples)
    print(f"# {torch.cuda.get_device_name()}, {args.samples} samples, 784-{args.width}-{args.width}-10, batch {args.batch}")
    for precision in ("32", "bf16-mixed"):
        run("backprop", precision, args.width, xy, args.epochs, args.batch)
    for precision in ("32", "bf16-mixed"):
        for backend in (None, "reference"):
            run("tween", precision, args.width, xy, args.epochs, args.batch, backend)
    run("tween", "bf16-mixed", args.width, xy, args.epochs, args.batch, None, watch=False)


if __name__ == "__main__":
    main()
