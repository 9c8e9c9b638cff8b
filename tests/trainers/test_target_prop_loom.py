"""TargetProp against real Loom (``welvet`` = Loom v0.80, ``poly/tween.go``), SPEC §8 and §12.

What Loom's C ABI lets us reach (../shared/LOOM_ORACLE.md; every welvet call runs in a child process
with a timeout, since several of them crash or hang the process):

* **Pure (layer-wise) mode** through the step mesh: ``LoomApplyTween`` runs ``StepApplyTween``, which
  always builds its own state with ``UseChainRule = false`` and the default momentum 0.9, and does
  backward targets → ``CalculateLinkBudgets`` → ``ApplyTweenGaps``. Nothing but the weights comes
  back, so the comparison is on the weight change, which carries every quantity of the spec:
  ``ΔW_i = (1−μ)·lr·(0.5 + 0.5·budget_i)·gap_iᵀ x_i`` with ``gap_i = target_i − a_i`` (targets,
  budgets, gating and the momentum factor all enter it). Loom's two bugs in this mode (SPEC §13:
  ``[out, in]`` weights read as ``[in, out]``; only the first sample used) are kept out of the way:
  batch 1, and the weights whose estimates matter (every layer but the first) are symmetric, so
  reading them transposed changes nothing. Loom's update itself lands transposed, so ``ΔWᵀ`` is
  compared. ``depth_scale_factor=1`` (Loom never reads it).
* **Chain-rule mode** only through an explicit tween state (``LoomCreateTweenState``: default config,
  chain rule on) with ``LoomTweenForward``/``LoomTweenBackward``/``LoomApplyTweenGaps``. No export calls
  ``CalculateLinkBudgets`` on such a state, so its budgets stay 0 and ``ApplyTweenGaps`` skips every
  layer; ``LoomTweenForward`` builds a 1-d input whose length Loom takes as the batch size, so it
  works only for networks with one input. What can be compared: the forward output, and that the
  update without budgets leaves every weight alone (torchloom's budgets also start at 0).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom import TargetPropTrainer
from torchloom.methods.target_prop import (
    TargetPropConfig,
    TargetPropState,
    apply_target_prop_gaps,
    target_prop_backward,
    target_prop_forward,
)

pytestmark = pytest.mark.loom

TESTS_DIR = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# The Loom side, run as a child process: ``python this_file.py`` with a JSON request on stdin.


def _loom_worker(request: dict) -> dict:
    import base64
    import ctypes

    sys.path.insert(0, str(TESTS_DIR))
    import welvet
    import welvet.utils as wu
    from loom_oracle import _check, _lib, _parse_safetensors, _take_string

    def read_weights(handle: int) -> dict:
        data = _check(_take_string(_lib().LoomSaveSafetensorsToBytes(handle)), "save safetensors")
        return {k: v.tolist() for k, v in _parse_safetensors(base64.b64decode(data["b64"])).items()}

    def b64(a) -> str:
        return base64.b64encode(np.asarray(a, dtype="<f4").tobytes()).decode()

    weights = [np.asarray(w, dtype=np.float32) for w in request["weights"]]
    acts = request["activations"]
    if request["kind"] == "step_mesh_pure":
        n_in = weights[0].shape[1]
        # A disabled layer first keeps the input in the mesh (the first live layer reads cell 0).
        layers = [{"z": 0, "y": 0, "x": 0, "l": 0, "type": "Dense", "activation": "Linear", "dtype": "float32",
                   "input_height": n_in, "output_height": n_in, "weights": b64(np.eye(n_in)), "is_disabled": True}]
        for i, (w, a) in enumerate(zip(weights, acts)):
            layers.append({"z": 0, "y": 0, "x": i + 1, "l": 0, "type": "Dense", "activation": a, "dtype": "float32",
                           "input_height": w.shape[1], "output_height": w.shape[0], "weights": b64(w)})
        wire = {"id": "tp", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1, "layers": layers}
        net = welvet.deserialize_network(json.dumps(wire))
        state = welvet.create_step_state(net)
        welvet.set_input(state, request["input"])
        for _ in range(len(weights)):  # one tick moves the signal one layer deeper
            welvet.mesh_step(net, state, False)
        outputs = [welvet.get_output(state, i + 1) for i in range(len(weights))]
        welvet.apply_tween(net, state, request["target"], request["lr"])
        after = read_weights(net)
        return {"outputs": outputs, "weights": [after[f"layer_{i + 1}.weights"] for i in range(len(weights))]}
    if request["kind"] == "tween_state_chain_rule":
        from loom_oracle import LoomDense

        sizes = [weights[0].shape[1]] + [w.shape[0] for w in weights]
        net = LoomDense(sizes, acts, weights)
        tp = welvet.create_tween_state(net.handle)
        out = welvet.tween_forward(net.handle, tp, request["input"])
        backward = wu._LIB["LoomTweenBackward"]  # welvet declares a char* result for this void function
        backward.restype = None
        backward.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_float), ctypes.c_int]
        target = (ctypes.c_float * len(request["target"]))(*request["target"])
        backward(net.handle, tp, target, len(request["target"]))
        apply = wu._LIB["LoomApplyTweenGaps"]
        apply.restype = None
        apply.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_float]
        apply(net.handle, tp, ctypes.c_float(request["lr"]))
        return {"outputs": [out], "weights": [w.tolist() for w in net.weights()]}
    raise ValueError(request["kind"])


def _run_loom(requests: list[dict]) -> list[dict]:
    """Run every request in one child process (a crash or hang there fails the test, not pytest)."""
    try:
        proc = subprocess.run(
            [sys.executable, __file__], input=json.dumps(requests), capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"Loom child process hung on {[r['kind'] for r in requests]}")
    if proc.returncode != 0:
        pytest.fail(f"Loom child process failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------


def _net(weights, activations) -> Network:
    layers = []
    for w, a in zip(weights, activations):
        w = torch.tensor(w, dtype=torch.float32)
        layer = Dense(w.shape[1], w.shape[0], a.lower(), bias=False)
        with torch.no_grad():
            layer.weight.copy_(w)
        layers.append(layer)
    return Network(*layers)


def _symmetric(n: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).uniform(-0.8, 0.8, (n, n))
    return ((a + a.T) / 2).astype(np.float32)


# Two cases: every layer updated, and the hidden layer gated (its budget < 0.2).
W_FIRST = np.random.default_rng(0).uniform(-0.8, 0.8, (4, 4)).astype(np.float32)  # any square matrix
W_SECOND = _symmetric(4, 1)
W_SECOND[3, :] = W_SECOND[:, 3] = [0.002, -0.001, 0.003, 0.001]  # Σ|W| < 0.01: that unit gets target 0
ACTS = ["Tanh", "Sigmoid"]
LR = 0.5
CASES = {
    "all_layers_update": dict(input=[0.68, -0.42, -0.96, 0.46], target=[0.96, 0.89, 0.04, 0.46]),  # budgets 0.98, 0.95
    "hidden_layer_gated": dict(input=[0.98, -0.17, -0.63, 0.56], target=[0.27, 0.57, 0.65, 0.2]),  # budgets 0.03, 0.94
}
CHAIN_WEIGHTS = [np.array([[0.3], [-0.5], [0.8]], np.float32), np.array([[0.5, -0.4, 0.1], [-0.4, 0.3, 0.2]], np.float32)]
CHAIN_CASE = dict(input=[0.7], target=[0.9, 0.1])


@pytest.fixture(scope="module")
def loom():
    """Loom's answers to every case, from one child process."""
    try:
        import welvet  # noqa: F401
    except Exception as e:  # not installed, or its native library fails to load
        pytest.skip(f"welvet (Loom's Python binding) is not usable here: {e}")
    requests = [
        {"kind": "step_mesh_pure", "weights": [W_FIRST.tolist(), W_SECOND.tolist()], "activations": ACTS, "lr": LR, **CASES[c]}
        for c in sorted(CASES)
    ]
    requests.append({"kind": "tween_state_chain_rule", "weights": [w.tolist() for w in CHAIN_WEIGHTS],
                     "activations": ACTS, "lr": LR, **CHAIN_CASE})
    answers = _run_loom(requests)
    return {**dict(zip(sorted(CASES), answers)), "chain_rule": answers[-1]}


def _pure_step(case: str, lr: float = LR):
    spec = CASES[case]
    net = _net([W_FIRST, W_SECOND], ACTS)
    before = [p.detach().clone() for p in net.parameters()]
    cfg = TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom", learning_rate=lr, depth_scale_factor=1.0)  # Loom: momentum 0.9, gate 0.2
    trainer = TargetPropTrainer(net, cfg)
    trainer.step(torch.tensor([spec["input"]]), torch.tensor([spec["target"]]))
    return net, before, trainer.state


def _loom_delta(answer: dict, i: int, before: torch.Tensor) -> np.ndarray:
    """Loom's weight change of layer i, transposed back to [out, in]."""
    return (np.asarray(answer["weights"][i], dtype=np.float32).reshape(before.shape) - before.numpy()).T


@pytest.mark.parametrize("case", sorted(CASES))
def test_pure_mode_step_matches_loom_step_mesh(loom, case):
    net, before, state = _pure_step(case)
    answer = loom[case]
    for i, out in enumerate(answer["outputs"]):  # forward_acts, Loom's LayerData after the ticks
        np.testing.assert_allclose(state.forward_acts[i + 1][0].numpy(), out, rtol=1e-6, atol=1e-7)
    gated = [i for i, b in enumerate(state.link_budgets) if b < 0.2]
    assert gated == ([0] if case == "hidden_layer_gated" else [])
    for i, (p, b) in enumerate(zip(net.parameters(), before)):
        ours = (p.detach() - b).numpy()
        theirs = _loom_delta(answer, i, b)
        if i in gated:
            assert np.all(theirs == 0) and np.all(ours == 0), f"layer {i} should be untouched"
            continue
        assert np.abs(ours).max() > 1e-4  # a real update, not two zeros
        # float32: the deltas are differences of weights ~0.8, so ~1 ulp (6e-8) of absolute error
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1.5e-7, err_msg=f"layer {i} weight change")


def test_pure_mode_comparison_would_see_a_wrong_rate(loom):
    """The comparison above is sensitive: a 1 % different rate (e.g. a wrong budget) fails it."""
    net, before, _ = _pure_step("all_layers_update", lr=LR * 1.01)
    ours = (net[1].weight.detach() - before[1]).numpy()
    assert not np.allclose(ours, _loom_delta(loom["all_layers_update"], 1, before[1]), rtol=1e-5, atol=1.5e-7)


def test_chain_rule_tween_state_forward_and_ungated_nothing(loom):
    """Loom's chain-rule state (only one input) never computes budgets: its update skips every layer,
    exactly as torchloom's apply_target_prop_gaps does before calculate_link_budgets."""
    answer = loom["chain_rule"]
    net = _net(CHAIN_WEIGHTS, ACTS)
    state = TargetPropState(net, TargetPropConfig(reduction="sum", learning_rate=LR))
    out = target_prop_forward(net, state, torch.tensor([CHAIN_CASE["input"]]))
    np.testing.assert_allclose(out[0].numpy(), answer["outputs"][0], rtol=1e-6, atol=1e-7)
    target_prop_backward(net, state, torch.tensor([CHAIN_CASE["target"]]))
    assert apply_target_prop_gaps(net, state, LR) == [0, 1]
    for i, w in enumerate(CHAIN_WEIGHTS):
        np.testing.assert_array_equal(np.asarray(answer["weights"][i], np.float32).reshape(w.shape), w)
        np.testing.assert_array_equal(net[i].weight.detach().numpy(), w)


if __name__ == "__main__":
    print(json.dumps([_loom_worker(r) for r in json.loads(sys.stdin.read())]))
    sys.exit(0)
