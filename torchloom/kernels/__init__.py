"""Fused Triton kernels, each beside a plain-PyTorch reference of the same math: the Triton
kernel runs on CUDA tensors, the reference on the CPU or without Triton.

Submodules are imported on first use, so ``import torchloom`` stays cheap and never imports Triton.
"""
