"""Reloading a trained model for inference (issue 33 item 2): ``torchloom.load_checkpoint`` and
``Checkpoint.load_best``. The reference is the trained model itself: a model reloaded from the file
gives its outputs exactly (the file was written after the last epoch, ``save_best_only=False``)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

import torchloom
from torchloom import Checkpoint, Conv2D, Dense, Flatten, LayerNorm, Network, TrainingConfig
from torchloom.saving import describe_network, rebuild_network


def _data(n_in: int = 4, n: int = 32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n_in, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _train(model, path, data=None, **kw) -> Checkpoint:
    ck = Checkpoint(path, save_best_only=False, **kw)
    x, y = data if data is not None else _data()
    torchloom.train(model, (x, y), TrainingConfig(epochs=2, batch_size=8, learning_rate=0.05, observers=[ck], verbose=False))
    return ck


def _mlp(seed: int) -> Network:
    torch.manual_seed(seed)
    return Network(Dense(4, 8, "relu"), LayerNorm(8), Dense(8, 1))


def test_reload_into_a_fresh_network_gives_the_trained_outputs(tmp_path):
    path = tmp_path / "best.pt"
    net = _mlp(0)
    ck = _train(net, path)
    x, _ = _data()
    want = net(x)
    fresh = _mlp(1)
    assert not torch.equal(fresh(x), want)  # the test can fail: other weights, other outputs
    got = torchloom.load_checkpoint(path, model=fresh)
    assert got is fresh and not got.training  # returned in eval mode, ready for inference
    assert torch.equal(got(x), want)
    other = ck.load_best(_mlp(2))
    assert torch.equal(other(x), want)


def test_rebuild_a_network_without_its_code(tmp_path):
    path = tmp_path / "best.pt"
    net = _mlp(0)
    _train(net, str(path))
    x, _ = _data()
    rebuilt = torchloom.load_checkpoint(path)
    assert isinstance(rebuilt, Network) and rebuilt is not net
    assert [type(m).__name__ for m in rebuilt] == ["Dense", "LayerNorm", "Dense"]
    assert [m.activation.name for m in (rebuilt[0], rebuilt[2])] == ["relu", "linear"]
    assert torch.equal(rebuilt(x), net(x))
    # the file carries the description as plain data: a weights_only load reads it
    state = torch.load(path, weights_only=True)
    assert state["network"]["loom"]["layers"][0]["bias"] is True
    assert "weights" not in state["network"]["loom"]["layers"][0]  # the weights are the state_dict's


def test_rebuild_a_convolutional_network_sized_by_the_training_inputs(tmp_path):
    path = tmp_path / "conv.pt"
    torch.manual_seed(0)
    net = Network(Conv2D(1, 2, 3, activation="relu"), Flatten(), Dense(2 * 4 * 4, 1, bias=False))
    x = torch.randn(8, 1, 6, 6)
    _train(net, path, data=(x, torch.randn(8, 1)))
    rebuilt = torchloom.load_checkpoint(path)
    assert [type(m).__name__ for m in rebuilt] == ["Conv2D", "Flatten", "Dense"]
    assert rebuilt[0].bias is not None and rebuilt[2].bias is None
    assert torch.equal(rebuilt(x), net(x))


def test_a_plain_module_reloads_into_a_given_model_and_asks_for_one_otherwise(tmp_path):
    path = tmp_path / "plain.pt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    _train(model, path)
    x, _ = _data()
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    assert torch.equal(torchloom.load_checkpoint(path, fresh)(x), model(x))  # under its own key names
    with pytest.raises(ValueError) as e:
        torchloom.load_checkpoint(path)
    assert str(e.value) == (
        f"load_checkpoint: cannot rebuild the model of {str(path)!r} without its code: it contains a plain "
        "nn.Module (Linear), whose code a checkpoint does not carry; pass the model to load the weights into: "
        f"load_checkpoint({str(path)!r}, model=<the model, built as for training>)"
    )


def test_a_state_dict_file_needs_the_model(tmp_path):
    path = tmp_path / "weights.pt"
    net = _mlp(0)
    _train(net, path, full_state=False)
    x, _ = _data()
    assert torch.equal(torchloom.load_checkpoint(path, _mlp(3))(x), net(x))
    with pytest.raises(ValueError) as e:
        torchloom.load_checkpoint(path)
    assert str(e.value) == (
        f"load_checkpoint: cannot rebuild the model of {str(path)!r} without its code: it holds a state_dict "
        "alone (Checkpoint(full_state=False), or model.state_dict()); pass the model to load the weights into: "
        f"load_checkpoint({str(path)!r}, model=<the model, built as for training>)"
    )


def test_a_network_loom_cannot_describe_gives_the_reason(tmp_path):
    path = tmp_path / "gelu.pt"
    torch.manual_seed(0)
    net = Network(Dense(4, 8, "gelu"), Dense(8, 1))
    _train(net, path)
    with pytest.raises(ValueError, match=r"without its code: Loom's network JSON cannot describe it: layer 0 \(Dense\): .*gelu"):
        torchloom.load_checkpoint(path)
    x, _ = _data()
    assert torch.equal(torchloom.load_checkpoint(path, Network(Dense(4, 8, "gelu"), Dense(8, 1)))(x), net(x))


def test_weights_that_do_not_fit_name_the_keys_and_change_nothing(tmp_path):
    path = tmp_path / "best.pt"
    _train(_mlp(0), path)
    torch.manual_seed(0)
    wrong = Network(Dense(4, 8, "relu"), Dense(8, 1))
    before = [p.clone() for p in wrong.parameters()]
    with pytest.raises(ValueError) as e:
        torchloom.load_checkpoint(path, wrong)
    assert str(e.value) == (
        f"load_checkpoint: the weights in {str(path)!r} do not fit this model (unexpected ['layers.2.bias', "
        "'layers.2.weight']; other shapes: layers.1.weight [8] vs [1, 8], layers.1.bias [8] vs [1]); "
        "pass the model the checkpoint was trained from"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, wrong.parameters()))


def test_bad_paths_and_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        torchloom.load_checkpoint(tmp_path / "none.pt")
    assert str(e.value) == f"load_checkpoint: no such file {str(tmp_path / 'none.pt')!r}"
    with pytest.raises(TypeError) as e:
        torchloom.load_checkpoint(3)
    assert str(e.value) == "load_checkpoint: path must be a str or os.PathLike, got int"
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(ValueError) as e:
        torchloom.load_checkpoint(listed, _mlp(0))
    assert str(e.value) == f"load_checkpoint: {str(listed)!r} holds a list, not a checkpoint (a dict)"
    path = tmp_path / "best.pt"
    _train(_mlp(0), path)
    with pytest.raises(TypeError) as e:
        torchloom.load_checkpoint(path, model="net")
    assert str(e.value) == "load_checkpoint: model must be an nn.Module (or a torchloom Network) to load the weights into, got str"


class _Boom:
    """A pickled object whose loading would run code (os.system): weights_only refuses it."""

    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_loading_never_runs_code_from_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"format": "torchloom-training-state-1", "x": _Boom()}, f, protocol=2)
    with pytest.raises(ValueError, match=r"is not a readable torchloom checkpoint \(UnpicklingError"):
        torchloom.load_checkpoint(path, _mlp(0))
    assert not (tmp_path / "pwned.txt").exists()


def test_a_damaged_description_is_refused_naming_the_field(tmp_path):
    desc = describe_network(_mlp(0))
    desc["loom"]["layers"][0]["bias"] = "yes"
    with pytest.raises(ValueError) as e:
        rebuild_network(desc)
    assert str(e.value) == "network description: layers[0]: 'bias' must be true or false, got 'yes'"
    desc = describe_network(_mlp(0))
    desc["dtype"] = "int8"
    with pytest.raises(ValueError) as e:
        rebuild_network(desc)
    assert str(e.value) == "network description: dtype must be one of ['bfloat16', 'float16', 'float32', 'float64'], got 'int8'"


def test_load_best_needs_a_model(tmp_path):
    ck = Checkpoint(tmp_path / "best.pt")
    with pytest.raises(TypeError) as e:
        ck.load_best(None)
    assert str(e.value) == (
        "Checkpoint.load_best: pass the model to load the best weights into; "
        f"torchloom.load_checkpoint({str(tmp_path / 'best.pt')!r}) rebuilds a torchloom Network without one"
    )
    with pytest.raises(FileNotFoundError):  # nothing saved yet
        ck.load_best(_mlp(0))


def test_a_description_that_rebuilds_other_parameters_asks_for_the_model(tmp_path):
    # Loom's JSON has no place for a Flatten before the first layer: the rebuilt network would be
    # Dense alone, whose parameters are named differently from the trained Flatten → Dense
    path = tmp_path / "flat.pt"
    torch.manual_seed(0)
    net = Network(Flatten(), Dense(16, 1))
    x = torch.randn(8, 4, 4)
    _train(net, path, data=(x, torch.randn(8, 1)))
    with pytest.raises(ValueError) as e:
        torchloom.load_checkpoint(path)
    assert str(e.value) == (
        f"load_checkpoint: cannot rebuild the model of {str(path)!r} without its code: the network it describes has "
        "other parameters than the weights it holds (first: 'layers.0.bias'); pass the model to load the weights "
        f"into: load_checkpoint({str(path)!r}, model=<the model, built as for training>)"
    )
    assert torch.equal(torchloom.load_checkpoint(path, Network(Flatten(), Dense(16, 1)))(x), net(x))
