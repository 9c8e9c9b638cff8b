"""Fused Triton kernels, each beside a plain-PyTorch reference of the same math (SPEC §11).

Submodules are imported on first use, so ``import torchloom`` stays cheap and never imports Triton.
"""
