"""The leaderboard as terminal text: columns fitted to the terminal's width, the searched keys
and the first four never left out (:func:`format_table`). Pure text; the table itself is
:mod:`raycl.tracking.trial_table`'s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection


def terminal_width(default: int = 100) -> int:
    """The terminal's columns: ``$COLUMNS`` or stdout's terminal (:func:`shutil.get_terminal_size`),
    else stderr's or stdin's (``raycl.tune ... | tee log`` still has one), else ``default``
    (``ray job logs``, a file)."""
    columns = shutil.get_terminal_size(fallback=(0, 0)).columns
    for fd in (2, 0):
        if columns > 0:
            break
        try:
            columns = os.get_terminal_size(fd).columns
        except (OSError, ValueError):
            continue
    return columns if columns > 0 else default


# Columns always shown: "#", the trial's name, its status and the objective.
_KEPT_COLUMNS = 4


def format_table(header: list[str], rows: list[list[str]], width: int | None = None,
                 keep: Collection[str] = ()) -> str:
    """Left-aligned columns under a dashed rule, for the terminal, at most ``width`` characters
    wide: columns beyond it are left out from the right, except the first four and those named
    in ``keep`` (the searched keys: what tells the trials apart), and named in a last line
    (every column is in ``leaderboard.csv`` and MLflow); a trial name too long is cut with
    "…"."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    shown = list(range(len(header)))
    if width is not None:
        # Left out first: the rightmost of the columns no one asked to keep.
        droppable = [i for i in reversed(shown) if i >= _KEPT_COLUMNS and header[i] not in keep]

        def total() -> int:
            return sum(widths[i] for i in shown) + 2 * (len(shown) - 1)

        while droppable and total() > width:
            shown.remove(droppable.pop(0))
        over = total() - width
        if over > 0 and len(shown) > 1:
            widths[1] = max(len(header[1]), 8, widths[1] - over)

    def cell(text: str, size: int) -> str:
        return text if len(text) <= size else text[:size - 1] + "…"

    def line(cells: list[str]) -> str:
        return "  ".join(cell(cells[i], widths[i]).ljust(widths[i]) for i in shown)

    lines = [line(header).rstrip(), line(["-" * w for w in widths]),
             *(line(row).rstrip() for row in rows)]
    left_out = [header[i] for i in range(len(header)) if i not in shown]
    if left_out:
        note = (f"{len(left_out)} more column(s) in leaderboard.csv and MLflow: "
                f"{', '.join(left_out)} (--wide or --columns shows them)")
        lines.append(cell(note, width) if width else note)
    return "\n".join(lines)


__all__ = ["format_table", "terminal_width"]
