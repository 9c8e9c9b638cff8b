"""Triton kernels keep their float math in float32 when a float argument arrives as float64.

Triton's own launcher passes a Python float as fp32, but Inductor, compiling a graph that holds a
user-defined Triton kernel, types it fp64 (``'qk_scale': 'fp64'`` in the flash-attention kernel's
signature on an H200, torch 2.11): ``qk · qk_scale`` then became float64 and the kernel did not
compile ("Loop-carried variable acc has initial type fp32 but is re-assigned to fp64"). Every kernel
that takes a float casts it to float32 first. Here each one is built to Triton IR for an sm_90 target
with its float arguments typed fp64 — on the CPU: building the IR needs no GPU — and the IR must hold
no float64 arithmetic: ``f64`` appears only in the kernel's signature and in the casts to ``f32``.

The build runs in a subprocess without the interpreter (``TRITON_INTERPRET=0``): under it the
kernels are interpreted functions, which Triton's code generator does not take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchloom.kernels._triton import triton_available

ROOT = Path(__file__).resolve().parents[2]

# (module, kernel, constexprs, float arguments); any other argument named ``*_ptr`` or one of the flash
# kernels' tensors (Q, K, V, ...) is a float32 pointer, the rest int32.
KERNELS = [
    ("flash_attention", "_fwd_kernel",
     dict(GROUP=1, CAUSAL=True, HEAD_DIM=8, BLOCK_D=16, BLOCK_M=128, BLOCK_N=64, PRECISION="tf32x3", UPCAST=False), ["qk_scale"]),
    ("flash_attention", "_bwd_dkdv_kernel",
     dict(CAUSAL=True, HEAD_DIM=8, BLOCK_D=16, BLOCK_M=32, BLOCK_N=32, PRECISION="tf32x3", UPCAST=False), ["qk_scale", "scale"]),
    ("flash_attention", "_bwd_dq_kernel",
     dict(CAUSAL=False, HEAD_DIM=8, BLOCK_D=16, BLOCK_M=32, BLOCK_N=32, PRECISION="tf32x3", UPCAST=False), ["qk_scale", "scale"]),
    ("layernorm", "_norm_forward_kernel", dict(RMS=False, HAS_BIAS=True, ROWS=4, BLOCK=256), ["eps"]),
    ("rmsnorm", "_rmsnorm_kernel", dict(BLOCK=256, SINGLE=False), ["eps"]),
    ("softmax", "_softmax_kernel", dict(BLOCK=256, SINGLE=False), ["inv_temperature"]),
    ("softmax", "_softmax_backward_kernel", dict(BLOCK=256, SINGLE=False), ["inv_temperature"]),
    ("sgd", "_sgd_kernel",
     dict(BLOCK=1024, LR_ON_DEVICE=False, HAS_SCALE=False, HAS_FOUND_INF=False, HAS_CLIP=True, HAS_WD=True,
          HAS_MOMENTUM=True, FIRST_STEP=False, NESTEROV=True), ["lr", "momentum", "one_minus_dampening", "weight_decay", "clip_value"]),
    ("adamw", "_adamw_kernel",
     dict(BLOCK=1024, LR_ON_DEVICE=False, STEP_ON_DEVICE=False, HAS_SCALE=False, HAS_FOUND_INF=False, HAS_CLIP=True),
     ["lr", "beta2", "one_minus_beta1", "one_minus_beta2", "log_beta1", "log_beta2", "bias_correction1",
      "bias_correction2_sqrt", "eps", "weight_decay", "clip_value"]),
    ("mse", "_mse_kernel", dict(BLOCK=1024), ["inv_n"]),
    ("grad_norm", "_norm_finish_kernel", dict(BLOCK=64, HAS_CLIP=True), ["max_norm"]),
]

_SCRIPT = r"""
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton._C.libtriton import ir

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({"num_warps": 4})
out = {}
for module, name, constexprs, floats in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module("torchloom.kernels." + module), name)
    sig, consts = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            sig[arg], consts[(i,)] = "constexpr", constexprs[arg]
        elif arg in floats:
            sig[arg] = "fp64"
        elif arg.endswith("_ptr") or arg in ("Q", "K", "V", "O", "LSE", "DO", "DELTA", "DK", "DV", "DQ"):
            sig[arg] = "*fp32"
        else:
            sig[arg] = "i32"
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        mod = ASTSource(fn=fn, signature=sig, constexprs=consts).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
        out[name] = [line.strip() for line in str(mod).splitlines() if "f64" in line and not line.lstrip().startswith("#loc")]
    except Exception as e:  # the failure itself is the finding
        out[name] = "build failed: " + str(e).splitlines()[-1]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def fp64_builds():
    if not triton_available():
        pytest.skip("needs triton")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    spec = json.dumps([list(k) for k in KERNELS])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, spec], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the IR build script failed:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("module,name,constexprs,floats", KERNELS, ids=[f"{m}.{n}" for m, n, _, _ in KERNELS])
def test_float64_scalar_arguments_stay_float32(fp64_builds, module, name, constexprs, floats):
    lines = fp64_builds[name]
    assert isinstance(lines, list), f"{module}.{name} with fp64 float arguments: {lines}"
    public = [line for line in lines if line.startswith("tt.func public")]
    assert len(public) == 1, f"{module}.{name}: expected the float64 arguments in the signature, got {lines}"
    # a helper taking the float64 value (``scalar_value``) and returning float32: its signature and call
    helpers = [line for line in lines if line.startswith("tt.func private") or (" tt.call " in line and "-> f32" in line)]
    casts = [line for line in lines if "arith.truncf" in line and ": f64 to f32" in line]
    others = [line for line in lines if line not in public + helpers + casts]
    assert not others, f"{module}.{name}: float64 math in {others}"
    assert len(casts) == len(floats), f"{module}.{name}: {len(casts)} casts for {len(floats)} float arguments: {casts}"
