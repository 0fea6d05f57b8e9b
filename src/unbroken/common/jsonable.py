"""Plain JSON values: what a checkpoint manifest's ``data_state`` and a drill report hold."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["plain_json"]


def plain_json(obj: Any, *, lossy: bool = False) -> Any:
    """``obj`` as plain JSON types (tuples -> lists, int keys -> str), as a reader of the
    written file would see it. An object JSON cannot hold makes the result ``None``; with
    ``lossy=True`` it is written as its ``str()`` instead."""
    try:
        return json.loads(json.dumps(obj, default=str if lossy else None))
    except (TypeError, ValueError):
        if lossy:
            raise
        return None
