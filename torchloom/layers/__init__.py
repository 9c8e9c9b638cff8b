"""Loom's layers as ``nn.Module``s with hand-written backwards (SPEC §3)."""

from .activations import ACTIVATIONS, Activation, activation_names, get_activation
from .base import Layer, LayerFunction, LayerRecord
from .dense import Dense, DenseFunction, dense
from .network import Network, Sequential

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "activation_names",
    "get_activation",
    "Layer",
    "LayerFunction",
    "LayerRecord",
    "Dense",
    "DenseFunction",
    "dense",
    "Network",
    "Sequential",
]
