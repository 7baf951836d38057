"""Tables of the ``dmref`` commands, readable at 80 columns.

Every command lays its tables out to fit 80 columns (fewer columns per table, or a summary with
``--wide`` for the full one). Should a terminal be narrower still, rich narrows the columns: text
columns wrap at spaces and number columns fold onto a second line (:func:`number_column`), so a
number is never cut to its first digits and an ellipsis.
"""

from __future__ import annotations

from rich import box
from rich.table import Table

__all__ = ["number_column", "print_wide", "table", "text_column"]


def table(title: str | None = None, **kwargs) -> Table:
    """A table with a rule under the header, no frame and no column lines (columns apart by
    spaces): the fewest columns spent on drawing, the title on the left above it."""
    kwargs.setdefault("box", box.SIMPLE_HEAD)
    kwargs.setdefault("show_edge", False)
    kwargs.setdefault("pad_edge", False)
    kwargs.setdefault("title_justify", "left")
    return Table(title=title, **kwargs)


def number_column(t: Table, header: str, **kwargs) -> None:
    """A right-aligned column of numbers that folds, never truncates, when space runs out."""
    t.add_column(header, justify="right", overflow="fold", **kwargs)


def text_column(t: Table, header: str, **kwargs) -> None:
    """A left-aligned column of words that wraps at spaces (and folds a word longer than it)."""
    t.add_column(header, justify="left", overflow="fold", **kwargs)


def print_wide(console, renderable) -> None:
    """Print ``renderable`` at its natural width, wider than the terminal if it must be (what a
    ``--wide`` option asks for); at the terminal's width if it fits."""
    from rich.console import Console
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(1 << 12), renderable).maximum
    if natural <= console.width:
        console.print(renderable)
    else:
        Console(width=natural, file=console.file, color_system=console.color_system,
                force_terminal=console.is_terminal).print(renderable)
