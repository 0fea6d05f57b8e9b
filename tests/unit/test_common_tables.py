"""The one table renderer: alignment, header, right-aligned numbers, bad rows refused."""

from __future__ import annotations

import pytest

from unbroken.common.tables import cell, render_table


def test_columns_align_to_the_widest_cell_and_numbers_right_align() -> None:
    text = render_table(
        [["3", "1.2 MB", "local"], ["12", "40 kB", "local+remote"]],
        header=["STEP", "SIZE", "STATUS"],
        right={0, 1},
    )
    assert text.splitlines() == [
        "STEP    SIZE  STATUS",
        "   3  1.2 MB  local",
        "  12   40 kB  local+remote",
    ]


def test_negative_right_index_indent_sep_min_widths_and_no_trailing_space() -> None:
    text = render_table(
        [("ok", "disk", 1.5), ("FAIL", "gpus", 10)],
        right={-1},
        sep=" ",
        indent="  ",
        min_widths=(6,),
    )
    assert text.splitlines() == ["  ok     disk 1.5", "  FAIL   gpus  10"]
    assert render_table([("a", ""), ("bbb", "")]) == "a\nbbb"  # empty last column: no padding


def test_empty_and_header_only() -> None:
    assert render_table([]) == ""
    assert render_table([], header=["A", "B"]) == "A  B"


def test_ragged_rows_and_unknown_columns_are_refused() -> None:
    with pytest.raises(ValueError, match="row 2 has 1 cells, the first has 2"):
        render_table([("a", "b"), ("c",)], header=("X", "Y"))
    with pytest.raises(ValueError, match=r"right=\[2\] names no column of a 2-column table"):
        render_table([("a", "b")], right={2})


def test_cell() -> None:
    assert cell(None) == "-" and cell(None, ".2f") == "-"
    assert cell(1.0, ".2f") == "1.00" and cell(3) == "3" and cell(1234.5, ",.0f") == "1,234"
