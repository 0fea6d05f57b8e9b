"""``python -m unbroken``: the ``unbroken`` command without the console script."""

from __future__ import annotations

import sys

from unbroken.cli import main

sys.exit(main())
