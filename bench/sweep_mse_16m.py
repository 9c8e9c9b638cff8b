"""MSE at 16M elements: the fused pass with and without its loss reduction, across launch settings.

Run on a GPU: ``PYTHONPATH=. python bench/sweep_mse_16m.py``. Prints % of copy bandwidth for 12 B/element.
"""

import torch
import triton.testing

from torchloom.kernels._triton import launch_override
from torchloom.kernels.mse import mse_loss_grad

n = 16 * 2**20
bufs = [(torch.randn(n, device="cuda"), torch.randn(n, device="cuda")) for _ in range(4)]
src = torch.empty(256 * 2**20 // 4, device="cuda")
dst = torch.empty_like(src)
copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
copy_bps = 2 * src.numel() * 4 / (copy_ms * 1e-3)
print(f"copy bandwidth {copy_bps / 1e9:.0f} GB/s")
i = [0]


def run(unreduced):
    o, y = bufs[i[0] % 4]
    i[0] += 1
    mse_loss_grad(o, y, unreduced=unreduced)


for block, warps in [(512, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]:
    with launch_override(block, warps):
        for unreduced in (False, True):
            ms = triton.testing.do_bench(lambda: run(unreduced), warmup=50, rep=300, return_mode="median")
            frac = 12 * n / (ms * 1e-3) / copy_bps
            print(f"BLOCK {block:5d}/{warps:2d}w {'partials only' if unreduced else 'with loss sum'}: {ms * 1e3:6.1f} us  {100 * frac:5.1f}% of copy")
