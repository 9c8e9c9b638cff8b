"""torchloom's optimizers (SPEC §6) against ``torch.optim`` with the same hyper-parameters: 100 steps on
a small model, through the references (CPU), the Triton kernels (interpreter on CPU tensors) and
natively on CUDA; AdamW's no-decay-on-biases default; state dicts; ``train()``'s names; the device
scalars (grad_scale, found_inf, tensor lr, capturable AdamW); bad arguments."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.optim.optimizers import OPTIMIZERS, SGD, AdamW, RMSprop, make_optimizer
from torchloom.optim.schedules import ScheduleLR, cosine_annealing
from torchloom.engine.train import train

# (device, backend): the references on CPU, the kernels through the interpreter and natively on CUDA
BACKENDS = [
    pytest.param("cpu", "reference", id="reference"),
    pytest.param(
        "cpu", "triton", id="interpreter",
        marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter"),
    ),
    pytest.param("cuda", None, id="cuda", marks=pytest.mark.cuda),
]


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def _data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g).to(device), torch.randn(16, 3, generator=g).to(device)


def _groups(model: nn.Module, spec: list[dict]) -> list[dict]:
    """Param groups: spec[i] applies to layer ``spec[i]['layer']`` (its weight and bias)."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    return [{"params": [layers[s["layer"]].weight, layers[s["layer"]].bias], **{k: v for k, v in s.items() if k != "layer"}} for s in spec]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, x: torch.Tensor, y: torch.Tensor) -> None:
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


# name → (torch factory, torchloom factory); both get the model and build the same groups
SGD_GROUPS = [dict(layer=0, momentum=0.8, nesterov=True, weight_decay=1e-3), dict(layer=1, momentum=0.9, dampening=0.1, weight_decay=0.01)]
CASES = {
    "sgd_momentum_nesterov_dampening": (
        lambda m: torch.optim.SGD(_groups(m, SGD_GROUPS), lr=0.03),
        lambda m, b: SGD(_groups(m, SGD_GROUPS), lr=0.03, backend=b),
    ),
    "sgd_plain": (
        lambda m: torch.optim.SGD(_groups(m, [dict(layer=0), dict(layer=1, weight_decay=0.01)]), lr=0.05),
        lambda m, b: SGD(_groups(m, [dict(layer=0), dict(layer=1, weight_decay=0.01)]), lr=0.05, backend=b),
    ),
    # torchloom's default puts biases in a no-decay group: torch gets the same two groups by hand
    "adamw_default_groups": (
        lambda m: torch.optim.AdamW(
            [{"params": [m[0].weight, m[2].weight]}, {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}], lr=0.01, weight_decay=0.1
        ),
        lambda m, b: AdamW(m.parameters(), lr=0.01, weight_decay=0.1, backend=b),
    ),
    "adamw_user_groups": (
        lambda m: torch.optim.AdamW(_groups(m, [dict(layer=0, weight_decay=0.05), dict(layer=1, lr=0.003, betas=(0.8, 0.99))]), lr=0.01),
        lambda m, b: AdamW(_groups(m, [dict(layer=0, weight_decay=0.05), dict(layer=1, lr=0.003, betas=(0.8, 0.99))]), lr=0.01, backend=b),
    ),
    "rmsprop": (
        lambda m: torch.optim.RMSprop(_groups(m, [dict(layer=0), dict(layer=1, momentum=0.9, centered=True, weight_decay=0.01)]), lr=0.005),
        lambda m, b: RMSprop(_groups(m, [dict(layer=0), dict(layer=1, momentum=0.9, centered=True, weight_decay=0.01)]), lr=0.005, backend=b),
    ),
}


# The interpreter runs ~4 ms per launch: it takes the cases that together cover every kernel flag
# (plain SGD and per-group AdamW settings are checked per step in tests/kernels/).
INTERPRETER_CASES = {"sgd_momentum_nesterov_dampening", "adamw_default_groups", "rmsprop"}


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optim_over_100_steps(case, device, backend):
    if backend == "triton" and case not in INTERPRETER_CASES:
        pytest.skip("covered through the interpreter by the other cases; runs natively on CUDA")
    make_torch, make_ours = CASES[case]
    x, y = _data(device)
    ref_model = _model(device)
    model = copy.deepcopy(ref_model)
    _train(ref_model, make_torch(ref_model), 100, x, y)
    _train(model, make_ours(model, backend), 100, x, y)
    for i, (p, r) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_close(p, r, name=f"{case} param {i} after 100 steps", rtol=1e-5, atol=1e-6)


def test_adamw_default_gives_biases_and_1d_params_no_weight_decay():
    model = _model("cpu")
    opt = AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.dim() == 2 for p in opt.param_groups[0]["params"]) and all(p.dim() == 1 for p in opt.param_groups[1]["params"])
    # zero gradients: Adam's step is 0, only the decoupled decay moves weights, by (1 − lr·wd)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    w0, b0, w1, b1 = before
    assert_close(model[0].weight, w0 * (1 - 0.1 * 0.1), name="weight decayed", rtol=1e-7, atol=0)
    assert torch.equal(model[0].bias, b0) and torch.equal(model[2].bias, b1)
    # user param groups are used as given: biases decay too
    opt2 = AdamW([{"params": list(model.parameters())}], lr=0.1, weight_decay=0.1)
    assert len(opt2.param_groups) == 1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    bias = model[0].bias.detach().clone()
    opt2.step()
    assert_close(model[0].bias, bias * 0.99, name="bias decayed with user groups", rtol=1e-7, atol=0)


@pytest.mark.parametrize("make", [
    lambda p: SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    lambda p: AdamW(p, lr=0.01),
    lambda p: RMSprop(p, lr=0.005, momentum=0.5, centered=True),
], ids=["sgd", "adamw", "rmsprop"])
def test_state_dict_round_trip_continues_exactly(make):
    x, y = _data("cpu")
    straight = _model("cpu")
    _train(straight, make(straight.parameters()), 60, x, y)

    first = _model("cpu")
    opt = make(first.parameters())
    _train(first, opt, 30, x, y)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = _model("cpu")
    resumed.load_state_dict(saved["model"])
    opt2 = make(resumed.parameters())
    opt2.load_state_dict(saved["opt"])
    _train(resumed, opt2, 30, x, y)
    for p, r in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, r)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adamw", "rmsprop"])
def test_train_accepts_optimizer_names(name):
    torch.manual_seed(3)
    net = Network(Dense(3, 5, "tanh"), Dense(5, 2))
    ref = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    with torch.no_grad():
        for dst, src in zip(ref.parameters(), net.parameters()):
            dst.copy_(src)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)) for _ in range(3)]
    lr = 0.02
    train(net, batches, epochs=4, learning_rate=lr, optimizer=name, verbose=False)
    weights, biases = [ref[0].weight, ref[2].weight], [ref[0].bias, ref[2].bias]
    ref_opt = {
        "sgd": lambda: torch.optim.SGD(ref.parameters(), lr=lr),
        "momentum": lambda: torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9),
        "adamw": lambda: torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=lr),
        "rmsprop": lambda: torch.optim.RMSprop(ref.parameters(), lr=lr),
    }[name]()
    for _ in range(4):
        for x, y in batches:
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
    for p, r in zip(net.parameters(), ref.parameters()):
        assert_close(p, r, name=f"{name} after train()", rtol=1e-5, atol=1e-6)


def test_registry_and_make_optimizer():
    assert set(OPTIMIZERS) == {"sgd", "momentum", "adam", "adamw", "rmsprop"}
    params = [nn.Parameter(torch.randn(2, 2))]
    assert isinstance(make_optimizer("AdamW", params, 0.1), AdamW)
    assert isinstance(make_optimizer("rmsprop", params, 0.1), RMSprop)
    momentum = make_optimizer("momentum", params, 0.1)
    assert isinstance(momentum, SGD) and momentum.defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        make_optimizer("lion", params, 0.1)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_found_inf_skips_and_grad_scale_scales(device, backend):
    x, y = _data(device)
    for make in (lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: AdamW(p, lr=0.01), lambda p: RMSprop(p, lr=0.01, momentum=0.9)):
        model = _model(device)
        opt = make(model.parameters())
        _train(model, opt, 2, x, y)
        before = copy.deepcopy(opt.state_dict())
        weights = [p.detach().clone() for p in model.parameters()]
        opt.step(found_inf=torch.tensor(1.0, device=device))
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        after = opt.state_dict()
        for key, state in before["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value)), name

        # grad_scale = 0.5 equals halving the gradients by hand
        twin = copy.deepcopy(model)
        twin_opt = make(twin.parameters())
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: load_state_dict may alias tensors
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad * 0.5
        opt.step(grad_scale=torch.tensor(0.5, device=device))
        twin_opt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_close(p, q, name="grad_scale", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_capturable_adamw_with_tensor_lr_matches_the_default(device, backend):
    x, y = _data(device)
    ref_model = _model(device)
    model = copy.deepcopy(ref_model)
    ref_opt = AdamW(ref_model.parameters(), lr=0.02, backend=backend)
    opt = AdamW(model.parameters(), lr=torch.tensor(0.02, device=device), capturable=True, backend=backend)
    ref_sched = ScheduleLR(ref_opt, cosine_annealing(0.02, 0.001, 20))
    sched = ScheduleLR(opt, cosine_annealing(0.02, 0.001, 20))
    for _ in range(20):
        for m, o, s in ((ref_model, ref_opt, ref_sched), (model, opt, sched)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
            s.step()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(cosine_annealing(0.02, 0.001, 20)(20))
    for p in model.parameters():
        assert opt.state[p]["step"].device == p.device and float(opt.state[p]["step"]) == 20
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert_close(p, r, name="capturable vs default", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make,match", [
    (lambda p: SGD(p, lr=0.0), "lr must be a finite number > 0"),
    (lambda p: SGD(p, lr=0.1, momentum=-0.5), "momentum"),
    (lambda p: SGD(p, lr=0.1, nesterov=True), "nesterov needs momentum > 0"),
    (lambda p: SGD(p, lr=0.1, backend="cuda"), "backend must be one of"),
    (lambda p: AdamW(p, betas=(0.9, 1.0)), r"betas\[1\]"),
    (lambda p: AdamW(p, betas=0.9), "betas must be a pair"),
    (lambda p: AdamW(p, eps=-1.0), "eps"),
    (lambda p: RMSprop(p, alpha=1.0), "alpha"),
    (lambda p: RMSprop(p, weight_decay=float("nan")), "weight_decay"),
])
def test_bad_hyper_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make([nn.Parameter(torch.randn(3))])
