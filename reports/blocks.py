"""What a section hands the template: tables, figures, notes. Plain data; the template escapes
every string in them (Jinja2 autoescape), and `reports.figures` escapes the strings that go into
Plotly figures."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Cell:
    text: str
    value: float | None = None   # the raw number (data-value attribute: exact, machine-readable)
    best: bool = False           # the best value of its column (within its group)
    cls: str = ""                # extra CSS class: "num", "bad", "good", "muted"
    title: str = ""              # tooltip (exact value, CI)
    href: str = ""               # the text links there (a relative URL the report makes itself)


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    name: str = ""               # data-table attribute (tests and links find tables by it)
    row_classes: list[str] = field(default_factory=list)
    note: str = ""
    sortable: bool = False       # a click on a column's header sorts the rows by it (data-value, else text)


@dataclass
class Figure:
    fig: Any                     # plotly.graph_objects.Figure
    name: str                    # data-figure attribute
    caption: str = ""
    table: Table | None = None   # the figure's values, for print and for exact reading


@dataclass
class Note:
    text: str
    kind: str = ""               # "warning": shown as a warning box (CSS class note-warning)
    name: str = ""               # data-note attribute (tests find notes by it)


@dataclass
class Pre:
    summary: str
    text: str
    open: bool = False


@dataclass
class KeyValues:
    items: list[tuple[str, str]]
    name: str = ""


Block = Table | Figure | Note | Pre | KeyValues


def fmt_num(v: Any) -> str:
    """A number for a table: about four significant digits, thousands separated; '–' for none."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, numbers.Integral):
        return f"{int(v):,}"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 10:
        return f"{x:.2f}"
    if a >= 1 or a == 0:
        return f"{x:.3f}"
    return f"{x:.4g}"


def fmt_short(v: Any) -> str:
    """A number for a label drawn on a figure: three significant digits, no trailing zeros."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    x = float(v)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def nice(v: Any) -> Any:
    """An integer-valued float as an int (1.0 -> 1), for labels; anything else unchanged."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    return v


def num_cell(v: Any, scale: float = 1.0, ci: Any = None, best: bool = False) -> Cell:
    """A numeric cell: text in display units (value × scale), optional CI, raw value kept."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return Cell("–", None, cls="num muted")
    if isinstance(v, numbers.Integral) and scale == 1:
        v = int(v)
    elif isinstance(v, numbers.Real):
        v = float(v)
    text = fmt_num(v if scale == 1 else v * scale)
    title = f"{v!r}"
    if ci is not None and len(ci) == 2 and ci[0] is not None and ci[1] is not None:
        text += f" [{fmt_num(ci[0] * scale)}–{fmt_num(ci[1] * scale)}]"
        title += f"; 95% CI [{ci[0]!r}, {ci[1]!r}]"
    return Cell(text, v, best=best, cls="num", title=title)
