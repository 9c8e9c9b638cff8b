"""Loom's layers as ``nn.Module``s with hand-written backwards, checked by ``gradcheck`` in float64."""

from .activations import ACTIVATIONS, Activation, activation_names, get_activation
from .attention import MultiHeadAttention, MultiHeadAttentionFunction, multi_head_attention
from .base import Layer, LayerFunction, LayerRecord
from .containers import Parallel, Residual
from .conv import Conv1D, Conv2D, Conv3D, ConvFunction, Flatten, conv
from .conv_transpose import ConvTranspose1D, ConvTranspose2D, ConvTranspose3D, ConvTransposeFunction, conv_transpose
from .dense import Dense, DenseFunction, dense
from .embedding import Embedding, EmbeddingFunction, embedding
from .lstm import LSTM, LSTMFunction, lstm
from .module_layer import ModuleLayer
from .network import Network, Sequential
from .norm import LayerNorm, LayerNormFunction, RMSNorm, RMSNormFunction, layer_norm, rms_norm
from .rnn import RNN, LastStep, RNNFunction, rnn
from .softmax import Softmax, SoftmaxFunction, softmax
from .swiglu import SwiGLU, SwiGLUFunction, swiglu

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "activation_names",
    "get_activation",
    "Layer",
    "LayerFunction",
    "LayerRecord",
    "Network",
    "ModuleLayer",
    "Sequential",
    "Dense",
    "DenseFunction",
    "dense",
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "ConvFunction",
    "conv",
    "ConvTranspose1D",
    "ConvTranspose2D",
    "ConvTranspose3D",
    "ConvTransposeFunction",
    "conv_transpose",
    "Flatten",
    "RNN",
    "RNNFunction",
    "rnn",
    "LastStep",
    "LSTM",
    "LSTMFunction",
    "lstm",
    "Embedding",
    "EmbeddingFunction",
    "embedding",
    "MultiHeadAttention",
    "MultiHeadAttentionFunction",
    "multi_head_attention",
    "SwiGLU",
    "SwiGLUFunction",
    "swiglu",
    "RMSNorm",
    "RMSNormFunction",
    "rms_norm",
    "LayerNorm",
    "LayerNormFunction",
    "layer_norm",
    "Softmax",
    "SoftmaxFunction",
    "softmax",
    "Residual",
    "Parallel",
]
