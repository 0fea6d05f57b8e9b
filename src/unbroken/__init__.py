"""unbroken: keep PyTorch training jobs fed and alive."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
