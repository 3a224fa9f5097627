"""The leaderboard as terminal text: columns fitted to the terminal's width, the searched keys
and the first four never left out, the objective's test counterpart kept before the name is cut
(to its number, ``t03``, at the most: the searched values beside it say the rest)
(:func:`format_table`, :func:`fit_columns`). Pure text; the table itself is
:mod:`raycl.tracking.trial_table`'s.
"""

from __future__ import annotations

import os
import re
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
# The narrowest a status (``stopped at 12…``) and a trial's name are cut to.
_MIN_STATUS, _MIN_NAME = 14, 8


def format_table(header: list[str], rows: list[list[str]], width: int | None = None,
                 keep: Collection[str] = ()) -> str:
    """Left-aligned columns under a dashed rule, for the terminal, at most ``width`` characters
    wide where that can be (:func:`fit_columns`): the first four columns, those named in
    ``keep`` (the searched keys: what tells the trials apart) and the objective's test
    counterpart stay; the columns left out are named in a last line (every column is in
    ``leaderboard.csv`` and MLflow); a cell too long is cut with "…", a dotted header first
    shortened to its last part (``temperature``)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    shown = list(range(len(header)))
    if width is not None:
        shown, widths = fit_columns(header, rows, width, keep)

    def line(cells: list[str], titles: bool = False) -> str:
        return "  ".join((_title if titles else _cut_name if i == 1 else _cut)(
            cells[i], widths[i]).ljust(widths[i]) for i in shown)

    lines = [line(header, titles=True).rstrip(), line(["-" * w for w in widths]),
             *(line(row).rstrip() for row in rows)]
    left_out = [header[i] for i in range(len(header)) if i not in shown]
    if left_out:
        note = (f"{len(left_out)} more column(s) in leaderboard.csv and MLflow: "
                f"{', '.join(left_out)} (--wide or --columns shows them)")
        lines.append(_cut(note, width) if width else note)
    return "\n".join(lines)


def fit_columns(header: list[str], rows: list[list[str]], width: int,
                keep: Collection[str] = ()) -> tuple[list[int], list[int]]:
    """The columns shown and each one's width, to fit ``width``.

    The objective's test counterpart (a ``test/`` column right after the first four) is what
    a reader compares the objective with, and a trial's name is what they look up: so first
    the columns no one asked to keep are left out from the right, then the kept knob columns
    are narrowed (their header shortened, never a value), then the status, and only then the
    name (down to 8 characters, then, where the searched keys have their own columns, down to
    its number: ``t03 …``, the rest of a raycl name being those values). The whole name is
    shown wherever it fits beside the kept columns. When even that does not fit, the test
    column is left out as any other column and the name cut to what is left (knobs and status
    as they are).
    """
    test = _KEPT_COLUMNS if len(header) > _KEPT_COLUMNS and \
        header[_KEPT_COLUMNS].startswith("test/") else None
    if test is not None:
        shown, widths, over = _layout(header, rows, width, keep, test)
        if over <= 0:
            return shown, widths
    shown, widths, _ = _layout(header, rows, width, keep, None)
    return shown, widths


def _layout(header: list[str], rows: list[list[str]], width: int, keep: Collection[str],
            protected: int | None) -> tuple[list[int], list[int], int]:
    """:func:`fit_columns`' columns and widths with the ``protected`` column kept (knobs and
    status narrowed before the name), or with none (the name alone narrowed); and how many
    characters the table is still over ``width`` (0 or less: it fits)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    shown = list(range(len(header)))
    # Left out first: the rightmost of the columns no one asked to keep.
    droppable = [i for i in reversed(shown) if i >= _KEPT_COLUMNS and header[i] not in keep
                 and i != protected]
    while droppable and _total(widths, shown) > width:
        shown.remove(droppable.pop(0))
    over = _total(widths, shown) - width
    if protected is not None:
        over = _narrow(widths, {i: max((len(row[i]) for row in rows), default=1)
                                for i in shown if header[i] in keep}, over)  # never a value
        over = _narrow(widths, {2: _MIN_STATUS} if len(shown) > 2 else {}, over)
    if len(shown) > 1:
        over = _narrow(widths, {1: max(len(header[1]), _MIN_NAME)}, over)
    if protected is not None and over > 0 and any(header[i] in keep for i in shown):
        # The rest of a name (``t03 method=hscl p=0.31``) is the searched values, shown whole
        # in their own columns: its number alone names the trial, and the test column stays.
        over = _narrow(widths, {1: max([len(header[1])] + [len(_first_word(row[1]))
                                                          for row in rows])}, over)
    return shown, widths, over


def _total(widths: list[int], shown: list[int]) -> int:
    """The table's width: the shown columns and two spaces between each two."""
    return sum(widths[i] for i in shown) + 2 * (len(shown) - 1)


def _narrow(widths: list[int], minimum: dict[int, int], over: int) -> int:
    """Narrow the columns of ``minimum`` (the right-most first) toward their minimum until
    ``over`` characters are saved; returns how many are still over (0 or less: it fits)."""
    for i in sorted(minimum, reverse=True):
        cut = min(max(over, 0), max(0, widths[i] - minimum[i]))
        widths[i] -= cut
        over -= cut
    return over


def _first_word(name: str) -> str:
    """A trial's number in the sweep (``t03`` of ``t03 method=hscl p=0.31``); "" for a name that
    does not start with one (the untrained backbone's ``at init``: its status says what it is)."""
    first = name.split(" ", 1)[0]
    return first if re.fullmatch(r"[a-z]\d+", first) else ""


def _cut_name(text: str, size: int) -> str:
    """A trial's name in ``size`` characters (:func:`_cut`); narrower than :data:`_MIN_NAME`
    (the searched values have their own columns), its number and "…" (``t03 …``), or its
    number alone (``t103``), never a piece of a value."""
    first = _first_word(text)
    if len(text) <= size or size >= _MIN_NAME or not first or len(first) > size:
        return _cut(text, size)
    return f"{first} …" if len(first) + 2 <= size else first


def _cut(text: str, size: int) -> str:
    """``text`` in ``size`` characters: cut, its last one "…", when longer."""
    return text if len(text) <= size else text[:size - 1] + "…"


def _title(text: str, size: int) -> str:
    """A column's header in ``size`` characters: as it is, else a dotted key's last part
    (``simclr.temperature`` -> ``temperature``), else cut (:func:`_cut`)."""
    if len(text) > size and "." in text:
        text = text.rsplit(".", 1)[-1]
    return _cut(text, size)


__all__ = ["fit_columns", "format_table", "terminal_width"]
