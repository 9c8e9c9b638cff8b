"""Run real Loom (``welvet``, Loom v0.80's own Python binding) as the reference for parity tests.

See ``../shared/LOOM_ORACLE.md``. Each call runs inside this process through ctypes; the functions
used here (build, set weights, train, read weights) are the ones that oracle note lists as safe.
"""

from __future__ import annotations

import base64
import ctypes
import json
import struct

import numpy as np

welvet = None
try:  # pragma: no cover - depends on the environment
    import welvet  # type: ignore
    import welvet.utils as _wu  # type: ignore
except Exception:  # ImportError, or the native library failing to load
    welvet = None

__all__ = ["welvet", "LoomDense"]


def _lib():
    lib = _wu._LIB
    if not getattr(lib, "_torchloom_declared", False):
        lib.LoomSetLayerLoadedWeights.argtypes = [ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
        lib.LoomSetLayerLoadedWeights.restype = ctypes.c_void_p
        lib.LoomSaveSafetensorsToBytes.argtypes = [ctypes.c_longlong]
        lib.LoomSaveSafetensorsToBytes.restype = ctypes.c_void_p
        lib.LoomTrain.argtypes = [
            ctypes.c_longlong,
            ctypes.POINTER(ctypes.c_float), ctypes.c_int,
            ctypes.POINTER(ctypes.c_float), ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_char_p,
        ]
        lib.LoomTrain.restype = ctypes.c_void_p
        lib.FreeLoomString.argtypes = [ctypes.c_void_p]
        lib._torchloom_declared = True
    return lib


def _take_string(ptr: int) -> str:
    """Copy a C string returned by Loom and release it with ``FreeLoomString``."""
    lib = _lib()
    try:
        return ctypes.string_at(ptr).decode("utf-8")
    finally:
        lib.FreeLoomString(ptr)


def _check(text: str, what: str) -> dict | list | None:
    data = json.loads(text) if text else None
    if isinstance(data, dict) and "error" in data:
        raise RuntimeError(f"Loom {what}: {data['error']}")
    return data


def _parse_safetensors(raw: bytes) -> dict[str, np.ndarray]:
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    body = raw[8 + header_len :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        start, end = meta["data_offsets"]
        out[name] = np.frombuffer(body[start:end], dtype="<f4").reshape(meta["shape"]).copy()
    return out


class LoomDense:
    """A Loom ``poly`` network of Dense layers (no bias) in one grid row, with weights we choose.

    ``sizes = [in, h1, ..., out]``, ``activations`` one name per layer (Loom's spelling is
    case-insensitive); ``weights`` a list of float32 arrays ``[out, in]``."""

    def __init__(self, sizes: list[int], activations: list[str], weights: list[np.ndarray]) -> None:
        layers = [
            {
                "z": 0, "y": 0, "x": i, "l": 0, "type": "dense",
                "input_height": sizes[i], "output_height": sizes[i + 1],
                "activation": act, "dtype": "float32",
            }
            for i, act in enumerate(activations)
        ]
        cfg = {"id": "torchloom_parity", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1, "layers": layers}
        self.handle = welvet.build_network(cfg)
        self.sizes = sizes
        for i, w in enumerate(weights):
            w = np.asarray(w, dtype=np.float32)
            assert w.shape == (sizes[i + 1], sizes[i]), (w.shape, sizes)
            payload = json.dumps([repr(float(v)) for v in w.reshape(-1)]).replace('"', "")
            _check(_take_string(_lib().LoomSetLayerLoadedWeights(self.handle, i, 1, payload.encode())), "set weights")

    def weights(self) -> list[np.ndarray]:
        data = _check(_take_string(_lib().LoomSaveSafetensorsToBytes(self.handle)), "save safetensors")
        tensors = _parse_safetensors(base64.b64decode(data["b64"]))
        out = []
        for i in range(len(self.sizes) - 1):
            out.append(tensors[f"layer_{i}.weights"].reshape(self.sizes[i + 1], self.sizes[i]))
        return out

    def train(self, inputs: np.ndarray, targets: np.ndarray, *, epochs: int, learning_rate: float,
              loss_type: str = "mse", gradient_clip: float = 0.0) -> list[float]:
        """Run ``poly.Train``. ``inputs [num_batches, batch, in]``, ``targets [num_batches, batch, out]``
        (Loom needs equal batch sizes). Returns Loom's per-epoch loss history."""
        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        targets = np.ascontiguousarray(targets, dtype=np.float32)
        nb, bs, d_in = inputs.shape
        d_out = targets.shape[2]
        cfg = {"Epochs": epochs, "LearningRate": learning_rate, "LossType": loss_type,
               "GradientClip": gradient_clip, "Verbose": False, "UseGPU": False}
        fp = ctypes.POINTER(ctypes.c_float)
        text = _take_string(
            _lib().LoomTrain(
                self.handle,
                inputs.ctypes.data_as(fp), inputs.size,
                targets.ctypes.data_as(fp), targets.size,
                bs, d_in, d_out,
                json.dumps(cfg).encode(),
            )
        )
        return list(_check(text, "train")["loss_history"])

    def close(self) -> None:
        if self.handle is not None:
            welvet.free_network(self.handle)
            self.handle = None
