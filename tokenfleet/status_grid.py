"""A table that fits the terminal it is drawn on, without cutting a word or a number.

rich's ``Table`` shrinks every column to fit and then cuts cells with an ellipsis (``B1_sh…``), or wraps
them over several lines. ``Grid`` instead chooses, at each draw and for the width it is given, the
richest layout whose first line fits, in this order of what matters: every core column on the first
line; the name whole in its row (else it stands on a line of its own above its row, and the name column
takes at most a quarter of the terminal); progress bars; the extra columns (left out first, with a line
saying where they are: ``tokenfleet status NAME``). Core columns that still do not fit move to a second
line under their row (``ETA done · in flight 0``); a terminal too narrow even for the first few gets one
``header: value`` line each. No cell is ever cut, except a single word longer than the terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

#: Spaces between two columns.
GAP: Final = 2
#: Cells of a progress bar, and the space after it.
BAR_WIDTH: Final = 10
#: Where a row's second line (the columns that did not fit) starts.
INDENT: Final = 2
#: Between two items of a second line.
SEPARATOR: Final = " · "
#: A cell with nothing to say.
NOTHING: Final = "—"

Justify = Literal["left", "right"]


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    justify: Justify = "left"
    #: A core column moves to a second line under its row when it does not fit; an extra one is left
    #: out (the detail view shows it).
    core: bool = True


@dataclass(frozen=True, slots=True)
class Cell:
    """A cell's text, and optionally a progress bar (value against limit) drawn before it where there is
    room."""

    text: Text
    bar: tuple[int, int] | None = None

    @classmethod
    def of(cls, value: str | Text | Cell) -> Cell:
        if isinstance(value, Cell):
            return value
        return cls(value if isinstance(value, Text) else Text(value))

    def width(self, bars: bool) -> int:
        return cell_len(self.text.plain) + (BAR_WIDTH + 1 if bars and self.bar is not None else 0)

    def render(self, bars: bool) -> Text:
        if not bars or self.bar is None:
            return self.text
        return bar_text(*self.bar) + Text(" ") + self.text


def bar_text(value: int, limit: int, width: int = BAR_WIDTH) -> Text:
    """``value`` against ``limit`` in ``width`` cells: the done part heavy and coloured (``━``), the rest
    light and dim (``─``), so it reads without colour too."""
    done = width if limit <= 0 else min(width, int(width * value / limit))
    style = "green" if value >= limit else "magenta"
    return Text("━" * done, style=style) + Text("─" * (width - done), style="grey42")


@dataclass(frozen=True, slots=True)
class Layout:
    """Which columns sit on the first line (by index, the name column 0 always) and whether bars are
    drawn; the other core columns go to the second line."""

    shown: tuple[int, ...]
    bars: bool
    name_width: int
    widths: dict[int, int] = field(default_factory=dict)


class Grid:
    """Rows of cells under ``columns``; column 0 names the row. Renders at any width (see the module)."""

    def __init__(
        self,
        columns: Sequence[Column],
        rows: Iterable[Sequence[str | Text | Cell]],
        *,
        title: str | None = None,
        min_core: int = 1,
        hint: str = "",
    ) -> None:
        self.columns = list(columns)
        self.rows = [[Cell.of(c) for c in row] for row in rows]
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"a row has {len(row)} cells for {len(self.columns)} columns")
        self.title = title
        #: Core columns (after the name) that must stay on the first line, or the grid is stacked.
        self.min_core = min_core
        #: Said under the grid when an extra column is left out (where to find it).
        self.hint = hint

    # --- choosing -------------------------------------------------------------------------------

    def _width(self, index: int, bars: bool) -> int:
        cells = [row[index].width(bars) for row in self.rows]
        return max([cell_len(self.columns[index].header), *cells])

    def _name_widths(self, width: int) -> tuple[int, ...]:
        """The name column's widths to try: its longest name, then at most about a quarter of the
        terminal (at least 16), so that a long name goes on a line of its own instead of crowding out
        the figures."""
        longest = self._width(0, False)
        capped = min(longest, max(16, width // 4))
        return (longest,) if capped == longest else (longest, capped)

    def candidates(self, width: int) -> Iterator[Layout]:
        """Layouts from the richest down: every core column on the first line before anything else, then
        the name whole in its row, then bars, then the extra columns."""
        core = [i for i, c in enumerate(self.columns) if i and c.core]
        extra = [i for i, c in enumerate(self.columns) if i and not c.core]
        for n in range(len(core), self.min_core - 1, -1):
            for name_w in self._name_widths(width):
                if n < len(core):
                    yield self._layout(core[:n], False, name_w)
                    continue
                for bars in (True, False):
                    for k in range(len(extra), -1, -1):
                        yield self._layout(sorted(core + extra[:k]), bars, name_w)

    def _layout(self, shown: Sequence[int], bars: bool, name_w: int) -> Layout:
        return Layout((0, *shown), bars, name_w, {i: self._width(i, bars) for i in shown})

    def choose(self, width: int) -> Layout | None:
        """The richest layout whose first line fits ``width``; None: stack each row instead."""
        for layout in self.candidates(width):
            if self._line_width(layout) <= width:
                return layout
        return None

    # --- drawing --------------------------------------------------------------------------------

    def lines(self, width: int) -> list[Text]:
        out: list[Text] = []
        if self.title:
            out.append(Text(self.title, style="bold"))
        if not self.rows:
            return out
        layout = self.choose(width)
        if layout is None:
            out.extend(self._stacked(width))
            return out
        out.append(self._line(layout, [Text(c.header, style="bold") for c in self.columns]))
        out.append(Text("─" * self._line_width(layout), style="dim"))
        moved = [i for i, c in enumerate(self.columns) if i and c.core and i not in layout.shown]
        for row in self.rows:
            name = row[0].text
            cells = [c.render(layout.bars) for c in row]
            if cell_len(name.plain) > layout.name_width:
                out.extend(_fold(name, width))
                cells[0] = Text("")
            out.append(self._line(layout, cells))
            if moved:
                # a figure with nothing to say (``—``) is left out of the second line
                items = [
                    Text(f"{self.columns[i].header} ", style="dim") + row[i].text
                    for i in moved
                    if row[i].text.plain != NOTHING
                ]
                out.extend(_flow(items, width, INDENT))
        hidden = [i for i, c in enumerate(self.columns) if i and not c.core and i not in layout.shown]
        out.extend(self._hint(hidden, width))
        return out

    def _line_width(self, layout: Layout) -> int:
        return layout.name_width + sum(layout.widths.values()) + GAP * len(layout.widths)

    def _line(self, layout: Layout, cells: Sequence[Text]) -> Text:
        line = _pad(cells[0], layout.name_width, "left")
        for i in layout.shown[1:]:
            line += Text(" " * GAP) + _pad(cells[i], layout.widths[i], self.columns[i].justify)
        line.rstrip()
        return line

    def _stacked(self, width: int) -> list[Text]:
        out: list[Text] = []
        for row in self.rows:
            name = row[0].text.copy()
            name.stylize("bold")
            out.extend(_fold(name, width))
            for i in range(1, len(self.columns)):
                if not self.columns[i].core:
                    continue
                item = Text(f"{self.columns[i].header}: ", style="dim") + row[i].text
                out.extend(_fold(Text(" " * INDENT) + item, width))
        out.extend(self._hint([i for i, c in enumerate(self.columns) if i and not c.core], width))
        return out

    def _hint(self, hidden: Sequence[int], width: int) -> list[Text]:
        """A line naming the extra columns left out, and where to find them."""
        if not hidden or not self.hint:
            return []
        left_out = ", ".join(self.columns[i].header for i in hidden)
        return _fold(Text(f"{left_out}: {self.hint}", style="dim"), width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines(options.max_width):
            line.no_wrap = True
            line.end = "\n"
            yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def _pad(text: Text, width: int, justify: Justify) -> Text:
    room = max(0, width - cell_len(text.plain))
    return Text(" " * room) + text if justify == "right" else text + Text(" " * room)


def _fold(text: Text, width: int) -> list[Text]:
    """``text`` in lines of at most ``width`` cells: whole when it fits, else cut only where it must be
    (a single word longer than the terminal)."""
    if cell_len(text.plain) <= width:
        return [text]
    lines = list(text.wrap(Console(width=width, color_system=None), width, overflow="fold"))
    for line in lines:
        line.rstrip()
    return lines


def _flow(items: Sequence[Text], width: int, indent: int) -> list[Text]:
    """``items`` joined by ``SEPARATOR``, a new line (indented) before an item that would not fit."""
    out: list[Text] = []
    line = Text(" " * indent)
    filled = False
    for item in items:
        need = cell_len(item.plain) + (cell_len(SEPARATOR) if filled else 0)
        if filled and cell_len(line.plain) + need > width:
            out.append(line)
            line, filled = Text(" " * indent), False
        if filled:
            line += Text(SEPARATOR, style="dim")
        line += item
        filled = True
    if filled:
        out.extend(_fold(line, width))
    return out
