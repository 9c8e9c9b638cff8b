"""flatten_optimizer_: one buffer per group, one launch per group, the same numbers as torch.optim."""

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import triton_available
from torchloom.kernels._update import coalesce
from torchloom.optim.optimizers import SGD, AdamW, RMSprop, flatten_optimizer_

BACKENDS = ["reference"] + (["triton"] if triton_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "sgd-momentum": (lambda ps, b: SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, backend=b),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (lambda ps, b: AdamW(ps, lr=0.01, capturable=DEVICE == "cuda", backend=b),
              lambda ps: torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2]},
                                            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=0.01)),
    "rmsprop-centered-momentum": (lambda ps, b: RMSprop(ps, lr=0.01, momentum=0.5, centered=True, backend=b),
                                  lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True)),
}


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (7,), (3, 7), (3,)]
    return [torch.randn(s, generator=g).to(DEVICE) for s in shapes]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_flat_layout_keeps_values_and_matches_torch(name, backend):
    make, make_ref = CASES[name]
    ours = [torch.nn.Parameter(t.clone()) for t in _params()]
    ref = [torch.nn.Parameter(t.clone()) for t in _params()]
    opt, ref_opt = make(ours, backend), make_ref(ref)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g).to(DEVICE) for p in ours] for _ in range(12)]
    for k, step_grads in enumerate(grads):
        for p, r, gr in zip(ours, ref, step_grads):
            if p.grad is None:
                p.grad = gr.clone()
            else:
                p.grad.copy_(gr)  # keep the flat gradient views
            r.grad = gr.clone()
        opt.step()
        ref_opt.step()
        if k == 1:
            before = [p.detach().clone() for p in ours]
            flatten_optimizer_(opt)
            assert all(torch.equal(a, p) for a, p in zip(before, ours))  # values unchanged
            for group in opt.param_groups:
                ps = group["params"]
                assert coalesce(ps) is not None and coalesce([p.grad for p in ps]) is not None
                for key, value in opt.state[ps[0]].items():
                    if value.shape == ps[0].shape:
                        assert coalesce([opt.state[p][key] for p in ps]) is not None, key
                    elif key == "step":
                        assert all(opt.state[p]["step"] is value for p in ps)
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_close(p, r, name=f"param {i}", rtol=1e-5, atol=1e-6)


def test_coalesce_refuses_what_is_not_back_to_back():
    buf = torch.arange(10.0)
    a, b = buf[0:4], buf[4:10]
    assert coalesce([a, b])[0][0].data_ptr() == buf.data_ptr()
    assert coalesce([b, a]) is None  # wrong order
    assert coalesce([buf[0:4], buf[5:10]]) is None  # a gap
    assert coalesce([torch.zeros(3), torch.zeros(3)]) is None  # two buffers
    assert coalesce([a]) is None  # nothing to gain
    assert coalesce([a, b], [torch.zeros(4), torch.zeros(6)]) is None  # every list must be flat
