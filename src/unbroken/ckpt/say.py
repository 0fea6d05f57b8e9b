"""One line for the user about what a restore did, whether or not they configured logging.

A training script that configures no logging sees nothing below WARNING, so a resumed run
would print nothing about what it restored (issue 21 item 5). :func:`say` logs the line
when the user's logging will show it, and otherwise prints it to stderr with an
``unbroken:`` prefix: one line either way, never two. ``quiet`` sends it to DEBUG only.
Arguments are escaped (:func:`~unbroken.common.text.printable`): they may quote files.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from unbroken.common.text import printable

__all__ = ["say"]


def say(logger: logging.Logger, level: int, msg: str, *args: Any, quiet: bool = False) -> None:
    """``logger.log(level, msg, *args)`` if a handler will show it, else one stderr line."""
    args = tuple(printable(a) if isinstance(a, str) else a for a in args)
    if quiet:
        logger.debug(msg, *args)
    elif logger.isEnabledFor(level) and logger.hasHandlers():
        logger.log(level, msg, *args)
    else:
        print("unbroken: " + (msg % args if args else msg), file=sys.stderr, flush=True)
