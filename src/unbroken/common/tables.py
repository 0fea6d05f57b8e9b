"""Plain-text tables: the one renderer every report, listing and CLI table uses.

    >>> print(render_table([["3", "1.2 MiB"], ["12", "40 KiB"]], header=["STEP", "SIZE"],
    ...                    right={0, 1}))
    STEP     SIZE
       3  1.2 MiB
      12   40 KiB

Columns are as wide as their widest cell (header included), separated by ``sep``; a column
listed in ``right`` is right-aligned (numbers), every other one left-aligned. Trailing
white space is stripped from every line, so a left-aligned last column (a free-text note or
reason) may be of any length without widening the table.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

__all__ = ["cell", "render_table"]

MISSING = "-"


def render_table(
    rows: Iterable[Sequence[object]],
    *,
    header: Sequence[str] | None = None,
    right: Collection[int] = (),
    sep: str = "  ",
    indent: str = "",
    min_widths: Sequence[int] = (),
) -> str:
    """The rows (and ``header``, when given, as the first line) as aligned lines joined by
    newlines. Cells are passed through ``str``. ``right`` holds column indices (negative
    ones count from the end) to right-align; ``indent`` prefixes every line; ``min_widths``
    gives the least width of the first columns (a status column that must line up across
    calls). Every row must have as many cells as the first (or the header)."""
    table = [[str(c) for c in r] for r in rows]
    if header is not None:
        table.insert(0, [str(c) for c in header])
    if not table:
        return ""
    n = len(table[0])
    for i, r in enumerate(table):
        if len(r) != n:
            raise ValueError(
                f"table row {i} has {len(r)} cells, the first has {n}: {r!r}; "
                "pass the same number of cells in every row"
            )
    bad = [c for c in right if not -n <= c < n]
    if bad:
        raise ValueError(f"right={sorted(bad)} names no column of a {n}-column table")
    right_cols = {c % n for c in right}
    widths = [max(len(r[c]) for r in table) for c in range(n)]
    for c, w in enumerate(min_widths[:n]):
        widths[c] = max(widths[c], w)
    return "\n".join(
        (
            indent
            + sep.join(
                cell.rjust(w) if c in right_cols else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(r, widths, strict=True))
            )
        ).rstrip()
        for r in table
    )


def cell(value: object, spec: str = "") -> str:
    """``value`` formatted with ``spec`` (``".2f"``, ``",.0f"``), or ``"-"`` when it is
    ``None``: a phase that did not happen, a step that was not reached."""
    return MISSING if value is None else format(value, spec)
