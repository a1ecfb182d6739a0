"""Model repository and the bundled models (``digits``)."""

from __future__ import annotations

from streamapp.models.repository import BUNDLED_MODELS_DIR, ModelConfig, ModelRepository

__all__ = ["BUNDLED_MODELS_DIR", "ModelConfig", "ModelRepository"]
