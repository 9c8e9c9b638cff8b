"""Live mode: serve a prediction for every sample of a stream while training on it, with any method
of the engine (``trainer.py``), Welvet's Lucy metrics and per-shock adaptation statistics
(``lucy.py``, ``report.py``), the CUDA paths (``device.py``) and River's test-then-train loop
(``online.py``). See docs/live.md."""

from .lucy import LucySnapshot, LucyWindow, availability, finalize, flip, score, soft_acc, zero_downtime
from .online import train_online
from .report import LiveRecord, LiveReport, ShockStats
from .trainer import SCHEDULES, LiveConfig, LiveTrainer, Ticket

__all__ = [
    "LiveTrainer", "LiveConfig", "Ticket", "SCHEDULES", "train_online", "LiveReport", "LiveRecord", "ShockStats",
    "LucySnapshot", "LucyWindow", "finalize", "score", "availability", "soft_acc", "zero_downtime", "flip",
]
