"""Attention and the recurrent layers under ``torch.compile`` with Inductor on CUDA (skipped without CUDA).

Two failures of issue 36 on an H200: Inductor's copy of the flash-attention kernels did not compile
(Inductor passes the Python float ``qk_scale`` as fp64), and a compiled LSTM at 64×64×256×256 ended
in an illegal memory access (its traced time loop launched the cell kernel into strided views of the
``[B, T, ·]`` buffers). Here each layer is compiled with ``fullgraph=True`` (Inductor, the default
backend) and its output and gradients must equal eager's, which runs the hand-written kernels
directly. CPU coverage of the same paths: ``tests/layers/test_compile.py`` (aot_eager) and
``tests/kernels/test_float_scalar_args.py`` (the kernels' IR with float64 scalars).
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_close

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _grads(module, x):
    return [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def _compare_compiled(make, x_shape, rtol, atol, seed=0, autocast=False):
    """Eager and ``torch.compile(fullgraph=True)`` copies of ``make()`` on CUDA, two steps each on the
    same input and output gradient (both under bf16 autocast with ``autocast``): outputs and every
    gradient equal. Returns Inductor's code."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(seed)
    eager = make().cuda()
    with torch.no_grad():  # weights away from the initial ones
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True)
    x = torch.randn(*x_shape, device="cuda")
    gy = None
    codes = []
    for step in range(2):
        xe = x.clone().requires_grad_()
        xc = x.clone().requires_grad_()
        eager.zero_grad(set_to_none=True)
        compiled_module.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            ye = eager(xe)
        gy = torch.randn_like(ye) if gy is None else gy
        ye.backward(gy)

        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                yc = compiled(xc)
            yc.backward(gy)
            return yc.detach()

        if step == 0:
            yc, codes = run_and_get_code(run)
        else:
            yc = run()
        torch.cuda.synchronize()
        assert_close(yc, ye.detach(), name=f"step {step} output", rtol=rtol, atol=atol)
        for i, (got, ref) in enumerate(zip(_grads(compiled_module, xc), _grads(eager, xe))):
            assert_close(got, ref, name=f"step {step} gradient {i}", rtol=rtol, atol=atol)
    torch._dynamo.reset()
    return codes


@pytest.mark.parametrize("causal", [True, False])
def test_compiled_attention_inductor_matches_eager(causal):
    """MultiHeadAttention (grouped-query in float32, where no PyTorch fused kernel applies: the Triton
    one runs; RoPE, ragged sequence length) compiled by Inductor: its generated code calls the flash
    path's core as the opaque operators (which launch the eager RoPE and flash kernels at run time; no
    traced copy of them), hands the forward one the q|k|v product's own buffer (RoPE in place, no
    copy), and matches eager."""
    import re

    from torchloom import MultiHeadAttention

    codes = _compare_compiled(lambda: MultiHeadAttention(64, 4, num_kv_heads=2, causal=causal), (2, 37, 64), rtol=1e-4, atol=1e-5)
    for op in ("flash_attention_core.default(", "flash_attention_core_backward.default("):
        assert any(f"torch.ops.torchloom.{op}" in c for c in codes), f"Inductor's code does not call torchloom.{op[:-1]}"
    forward = next(c for c in codes if "flash_attention_core.default(" in c)
    line = next(ln for ln in forward.splitlines() if "flash_attention_core.default(" in ln)
    # the buffer itself, or a view of all of it (Inductor's reinterpret_tensor at offset 0: no copy)
    rows, width = 2 * 37, (4 + 2 * 2) * 16  # B·S, (H + 2K)·D of the projection
    call = re.search(r"= torch\.ops\.torchloom\.flash_attention_core\.default\("
                     rf"(?:(buf\d+)|reinterpret_tensor\((buf\d+), \({rows}, {width}\), \({width}, 1\), 0\)),", line)
    assert call, f"flash_attention_core is not handed a buffer as it is (a copy between?): {line.strip()}"
    buf = call.group(1) or call.group(2)
    assert not re.search(rf"(clone|copy_)\w*(\.run)?\([^\n]*\b{buf}\b", forward), f"{buf} is copied"


def _attention_errors(module, x, gy, reference, input_grad=True):
    """Errors (Frobenius) of ``module``'s output and gradients on ``x`` (with or without an input
    gradient) against ``reference``'s ``(y, [dx, *param grads])`` in float64, relative to the reference
    at unit scale at least (``test_compile._rel``'s convention): without RoPE the key bias's gradient is
    zero in theory (the softmax ignores a shift of every score), and its error relative to float64's
    ~1e-16 would compare one rounding noise with another."""
    x = x.clone().requires_grad_(input_grad)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(gy)
    got = [y.detach(), x.grad, *(p.grad for p in module.parameters())]
    want = [reference[0], *reference[1]]
    return [None if g is None else float((g.double() - w).norm() / w.norm().clamp_min(1.0)) for g, w in zip(got, want)]


def _float64_attention(eager, x, gy):
    from torchloom.layers import attention as A

    ref = copy.deepcopy(eager).double()
    ref.spec = A.AttentionSpec(eager.num_heads, eager.num_kv_heads, eager.causal, eager.rope, eager.rope_theta, "reference")
    xr = x.double().requires_grad_()
    yr = ref(xr)
    yr.backward(gy.double())
    return yr.detach(), [xr.grad, *(p.grad for p in ref.parameters())]


@pytest.mark.parametrize("dtype,kv,bias,rope,causal,autocast", [
    (torch.bfloat16, 2, True, True, True, False),
    (torch.bfloat16, 4, False, True, False, False),
    (torch.float32, 4, True, True, True, False),
    (torch.float32, 4, True, False, True, True),
    (torch.float32, 2, True, True, True, True),
], ids=["bf16-grouped", "bf16-nobias-noncausal", "fp32", "fp32-autocast-norope", "fp32-autocast-grouped"])
def test_compiled_attention_traces_pytorchs_fused_kernel(dtype, kv, bias, rope, causal, autocast):
    """Where PyTorch's fused attention kernel serves the core, a compiled layer traces its flash path:
    Inductor's code calls the fused kernel's ATen operators (forward and backward) directly and no
    torchloom operator, with no graph break; the output and every gradient are as close to a float64
    reference (the materialised path) as eager's. Then a ragged batch (Dynamo compiles again with a
    symbolic batch size) stays on the traced path, and so does a step whose input needs no gradient."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    from torchloom import MultiHeadAttention
    from torchloom.kernels import flash_attention as FA

    torch._dynamo.reset()
    torch.manual_seed(0)
    b, s, d, h = 2, 77, 128, 4
    eager = MultiHeadAttention(d, h, num_kv_heads=kv, bias=bias, rope=rope, causal=causal, device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True)
    run_dtype = torch.bfloat16 if autocast else dtype
    q = torch.empty(b, s, h, d // h, device="cuda", dtype=run_dtype)
    k = torch.empty(b, s, kv, d // h, device="cuda", dtype=run_dtype)
    choice = FA.sdpa_choice(q, k, k, causal, (d // h) ** -0.5)
    assert choice is not None, "no fused kernel for this case on this GPU: the test asks of a case that has one"
    name = {FA.SDPA_FLASH: "flash", FA.SDPA_EFFICIENT: "efficient", FA.SDPA_CUDNN: "cudnn"}[choice]
    names = ["y", "dx", *(n for n, _ in eager.named_parameters())]
    for step, (batch, input_grad) in enumerate([(b, True), (b, True), (b + 1, True), (b + 1, False)]):
        x = torch.randn(batch, s, d, device="cuda", dtype=dtype)
        gy = torch.randn(batch, s, d, device="cuda", dtype=dtype)
        reference = _float64_attention(eager, x, gy)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            eager_err = _attention_errors(eager, x, gy, reference, input_grad)
            if step in (0, 2):  # the first compile, and the one for the ragged batch
                compiled_err, codes = run_and_get_code(_attention_errors, compiled, x, gy, reference, input_grad)
                text = "\n".join(codes)
                for op in (f"_scaled_dot_product_{name}_attention.default(", f"_scaled_dot_product_{name}_attention_backward.default("):
                    assert op in text, f"step {step}: Inductor's code does not call aten.{op[:-1]}"
                assert "torch.ops.torchloom." not in text, f"step {step}: a torchloom operator in the traced flash path"
            else:
                compiled_err = _attention_errors(compiled, x, gy, reference, input_grad)
        for n, c, e in zip(names, compiled_err, eager_err):
            assert (c is None) == (e is None), f"step {step}: {n}"
            if c is not None:
                assert c <= 1.5 * e + 1e-6, f"step {step}: {n}: compiled relative error {c:.3e} vs eager {e:.3e}"


def test_traced_kernel_choice_is_the_choice_for_the_layers_tensors():
    """The kernel a compiled layer's traced flash path picks while Dynamo traces (asked for one sample of
    one-row views: no tensor of the real size) is the one PyTorch's chooser picks for the tensors the
    traced path hands the kernel — q and k slices of one ``[B, S, H+K, D]`` buffer, v its own — at every
    batch size: dtypes, grouped heads, head sizes (8-multiples and not), one-token and long sequences."""
    from torchloom.kernels import flash_attention as FA
    from torchloom.layers import _traced_attention as TA

    cases = [(2048, 16, 16, 64, torch.bfloat16, True), (2048, 16, 16, 64, torch.float32, True),
             (77, 4, 2, 32, torch.bfloat16, True), (77, 4, 4, 32, torch.bfloat16, False),
             (77, 4, 4, 32, torch.float32, True), (77, 4, 2, 16, torch.float32, True),
             (1, 4, 4, 64, torch.bfloat16, True), (5, 8, 8, 128, torch.float16, False),
             (8192, 16, 16, 64, torch.bfloat16, True), (100, 2, 2, 40, torch.bfloat16, True),
             (64, 2, 2, 20, torch.float16, True), (33, 6, 3, 8, torch.float32, False)]
    dev = torch.device("cuda", torch.cuda.current_device())
    for s, h, kv, hd, dtype, causal in cases:
        got = TA.sdpa_choice_constant(s, h, kv, hd, dtype, dev, causal)
        for b in (1, 3, 8):
            if b * s * (h + 2 * kv) * hd > 1 << 26:
                continue
            qk = torch.empty(b, s, h + kv, hd, device="cuda", dtype=dtype)
            v = torch.empty(b, s, kv, hd, device="cuda", dtype=dtype)
            want = FA.sdpa_choice(qk[:, :, :h], qk[:, :, h:], v, causal, hd ** -0.5)
            assert got == want, f"{(b, s, h, kv, hd, dtype, causal)}: traced choice {got}, chooser {want}"


def test_compiled_lstm_inductor_matches_eager_at_a_large_shape():
    """LSTM at batch 64, hidden 256, 24 steps (the benchmark's batch and width; the buffers far larger
    than one allocator block) compiled by Inductor: outputs and gradients equal eager's (the persistent
    loop kernels, which the compiled graph calls through ``torchloom::lstm_loop`` and its backward)."""
    import torchloom

    codes = _compare_compiled(lambda: torchloom.LSTM(128, 256), (64, 24, 128), rtol=2e-4, atol=2e-5)
    for op in ("lstm_loop.default(", "lstm_loop_backward.default("):
        assert any(f"torch.ops.torchloom.{op}" in c for c in codes), f"Inductor's code does not call torchloom.{op[:-1]}"


@pytest.mark.parametrize("rnn_tf32,cublas_tf32,inductor_loops", [
    (False, False, True), (True, False, True), (True, True, True), (False, True, True), (True, False, False),
], ids=["exact", "rnn-tf32", "both-tf32", "rnn-exact-cublas-tf32", "opaque-operators"])
def test_compiled_rnn_routes_follow_pytorchs_switches(rnn_tf32, cublas_tf32, inductor_loops, monkeypatch):
    """The float32 RNN at batch 64, hidden 256, 24 steps compiled by Inductor, under each setting of
    PyTorch's RNN switch and cuBLAS's: outputs and gradients equal eager's. Inductor's own code
    launches the loop kernel, and the products are cuBLAS calls where the two switches agree, else
    ``fp32_matmul``'s kernel, also launched by Inductor's code; no opaque operator is called. With
    ``USE_INDUCTOR_LOOPS`` off, the opaque operators run instead (the benchmark's A/B)."""
    import torchloom
    from torchloom.kernels import recurrent as K

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", rnn_tf32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", cublas_tf32)
    monkeypatch.setattr(K, "USE_INDUCTOR_LOOPS", inductor_loops)
    tf32 = rnn_tf32 or cublas_tf32
    codes = _compare_compiled(lambda: torchloom.RNN(128, 256), (64, 24, 128),
                              rtol=2e-3 if tf32 else 2e-4, atol=2e-4 if tf32 else 2e-5)
    code = "\n".join(codes)
    opaque = [op for op in ("rnn_forward.default(", "rnn_loop_backward.default(", "recurrent_grads.default(")
              if f"torch.ops.torchloom.{op}" in code]
    if not inductor_loops:
        assert len(opaque) == 3, f"the opaque operators called: {opaque}"
        assert "_rnn_loop_kernel" not in code
        return
    assert not opaque, f"opaque operators in Inductor's code: {opaque}"
    assert "_rnn_loop_kernel" in code, "Inductor's code does not launch the loop kernel"
    assert ("_mm_many_kernel" in code) == (rnn_tf32 != cublas_tf32), "fp32_matmul exactly where the switches disagree"


def test_compiled_rnn_under_bf16_autocast_and_dynamic_shapes():
    """The RNN compiled by Inductor under bf16 autocast (the loops launched by Inductor's code, the
    products bf16 cuBLAS calls) equals eager; and compiled with ``dynamic=True`` it takes batches and
    sequence lengths it was not traced for, with the numbers of eager (float32)."""
    import torch._dynamo

    import torchloom

    _compare_compiled(lambda: torchloom.RNN(128, 256), (64, 24, 128), rtol=2e-2, atol=2e-2, autocast=True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = torchloom.RNN(32, 64).cuda()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    from torch._inductor.utils import run_and_get_code

    for B, T in ((8, 5), (12, 9), (33, 3)):
        x = torch.randn(B, T, 32, device="cuda", requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        gy = torch.randn(B, T, 64, device="cuda")
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.backward(gy)
        grads = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        layer.zero_grad(set_to_none=True)

        def step():
            out = compiled(xc)
            out.backward(gy)
            return out

        if B == 8:  # the first, traced call: the loop kernel launched by Inductor's code
            yc, codes = run_and_get_code(step)
            assert "_rnn_loop_kernel" in "\n".join(codes)
        else:
            yc = step()
        assert_close(yc.detach(), y.detach(), name=f"B={B} T={T} output", rtol=2e-4, atol=2e-5)
        for i, (got, ref) in enumerate(zip([xc.grad, *(p.grad for p in layer.parameters())], grads)):
            assert_close(got, ref, name=f"B={B} T={T} gradient {i}", rtol=2e-4, atol=2e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("tf32", [True, False], ids=["rnn-switch-tf32", "rnn-switch-ieee"])
def test_compiled_float32_rnn_without_its_loop_kernel_has_no_graph_break(tf32, monkeypatch):
    """A float32 RNN whose loop kernel does not apply (here switched off; hidden sizes above 1,024
    alike) traces the cuBLAS step loop with ``fullgraph=True`` and equals eager, whichever precision
    PyTorch's RNN switch asks of its projections (they are ``torchloom::recurrent_mm``, which reads
    the switches at run time: read while tracing, the switch's getter is a graph break)."""
    import torchloom
    from torchloom.kernels import recurrent as K

    monkeypatch.setattr(K, "USE_PERSISTENT_RNN", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    _compare_compiled(lambda: torchloom.RNN(48, 64), (8, 6, 48), rtol=2e-3 if tf32 else 2e-4, atol=2e-4 if tf32 else 2e-5)
