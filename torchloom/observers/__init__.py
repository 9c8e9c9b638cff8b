"""Observers of training (SPEC §10): the protocol, history and console output."""

from .base import HOOKS, Observer, ObserverList
from .history import History
from .progress import EpochLinePrinter, format_duration, format_epoch_line

__all__ = ["HOOKS", "Observer", "ObserverList", "History", "EpochLinePrinter", "format_duration", "format_epoch_line"]
