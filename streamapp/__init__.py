"""streamapp: Kafka stream processing that turns keyed device events into model predictions."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
