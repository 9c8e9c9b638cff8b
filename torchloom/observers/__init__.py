"""Observers of training: the protocol, history, console output, files and callbacks."""

from .base import HOOKS, Observer, ObserverList
from .callbacks import Checkpoint, EarlyStopping, TerminateOnDivergence
from .console import ConsoleObserver
from .csv_logger import CSVLogger
from .gradient_stats import print_gradient_stats
from .history import History
from .layer_stats import LayerEvent, LayerEvents, LayerStats
from .plots import LossPlot
from .progress import EpochLinePrinter, ProgressObserver, format_duration, format_epoch_line, human_duration
from .tensorboard import TensorBoardLogger

__all__ = [
    "HOOKS",
    "Observer",
    "ObserverList",
    "History",
    "EpochLinePrinter",
    "ProgressObserver",
    "ConsoleObserver",
    "LayerStats",
    "LayerEvent",
    "LayerEvents",
    "print_gradient_stats",
    "LossPlot",
    "CSVLogger",
    "TensorBoardLogger",
    "EarlyStopping",
    "Checkpoint",
    "TerminateOnDivergence",
    "format_duration",
    "format_epoch_line",
    "human_duration",
]
