"""How results read for a person: the stdout console, one table style, and one way to write
sizes, counts, id runs, small numbers, model_weights_ids, placed files and checkpoint states.

At a terminal, lines wrap at word boundaries and tables fit the width by leaving out their
least needed columns (a note names them; `--wide` keeps them). Written to a file or a pipe,
nothing wraps, every column is kept, ids are whole and no line ends in spaces, so the output
greps cleanly. `TTY_COMPATIBLE=1` (Rich's variable) treats stdout as a terminal, `COLUMNS`
sets its width; both are read when a result is printed.

Names come from files, keys and datasets that anyone may have written, so nothing printed is
ever run by the terminal: every console here escapes control characters (`\\x1b`, `\\x07`,
C1, DEL and the bidi overrides that reorder a line) and reads no console markup or emoji codes
in what it prints (`[bold]` in a file name prints as it is). Style comes from `Text` spans only.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, ConsoleDimensions, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 100_000  # a line written to a file or pipe is never wrapped below this
ID_PREFIX = 8  # model_weights_ids are shortened to unique prefixes of at least this many characters


# ------------------------------------------------------------ escaping
# What a terminal would act on rather than show: C0 controls (ESC, BEL, CR, BS, ...), DEL, C1
# controls (0x9b is a CSI of its own) and the bidi marks, embeddings, overrides and isolates
# that reorder the rest of a line. Newlines and tabs are layout where a console prints a
# message, and are escaped too inside one value (a table cell, a title).
_CONTROLS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[{_CONTROLS}]")
_UNSAFE_IN_VALUE = re.compile(f"[{_CONTROLS}\t\n]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str, *, lines: bool = False) -> str:
    """`text` with every control character escaped (`\\x1b`, `\\x9b`, `\\u202e`), so that a name
    shows as what it is and never moves the cursor, retitles a window or reorders a line.
    With `lines`, newlines and tabs are kept (a message's own layout)."""
    return (_UNSAFE if lines else _UNSAFE_IN_VALUE).sub(_escape, text)


def printable_text(text: Text, *, lines: bool = False) -> Text:
    """A Text with its control characters escaped as `printable` does, its styles kept on the
    characters they covered."""
    pattern = _UNSAFE if lines else _UNSAFE_IN_VALUE
    source = text.plain
    if not pattern.search(source):
        return text
    pieces: list[str] = []
    moved = [0] * (len(source) + 1)  # where each offset of `source` lands in the escaped text
    at = 0
    for i, char in enumerate(source):
        moved[i] = at
        piece = pattern.sub(_escape, char)
        pieces.append(piece)
        at += len(piece)
    moved[len(source)] = at
    escaped = Text(
        "".join(pieces),
        style=text.style,
        justify=text.justify,
        overflow=text.overflow,
        no_wrap=text.no_wrap,
        end=text.end,
        tab_size=text.tab_size,
    )
    for span in text.spans:
        escaped.stylize(span.style, moved[min(span.start, len(source))], moved[min(span.end, len(source))])
    return escaped


class SafeConsole(Console):
    """A Rich console that shows what it is given and never lets the terminal act on it.

    Strings are plain text by default (no markup, no emoji codes: pass `markup=True` for a
    literal of rbtool's own), and control characters are escaped in every string and Text it
    prints and, as a last net, in every segment it writes (Rich's own cursor and style codes
    are control segments and pass as they are).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("markup", False)
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text, lines=True), **kwargs)

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        shown = tuple(printable_text(o, lines=True) if isinstance(o, Text) else o for o in objects)
        super().print(*shown, **kwargs)

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        safe = (
            Segment(printable(text, lines=True), style, None)
            if control is None and _UNSAFE.search(text)
            else Segment(text, style, control)
            for text, style, control in buffer
        )
        return super()._render_buffer(safe)


# ------------------------------------------------------------ the console
class ResultConsole(SafeConsole):
    """stdout for results: word-wrapped and fitted at a terminal; unwrapped and without trailing
    spaces when piped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fixed_width: int | None = kwargs.get("width")  # None: follow the terminal

    @property
    def size(self) -> ConsoleDimensions:
        """The terminal's size, read when asked (COLUMNS first), never frozen when rbtool starts."""
        if self._fixed_width is not None:
            return ConsoleDimensions(self._fixed_width, 25)
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit() and int(columns) > 0:
            return ConsoleDimensions(int(columns), 25)
        return ConsoleDimensions(shutil.get_terminal_size((80, 25)).columns or 80, 25)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._fixed_width = new_size[0]

    @property
    def width(self) -> int:
        return self.size.width

    @width.setter
    def width(self, width: int) -> None:
        self._fixed_width = width

    @property
    def piped(self) -> bool:
        """True when stdout is a file or pipe (TTY_COMPATIBLE=1 says it is a terminal, =0 that it is not)."""
        forced = os.environ.get("TTY_COMPATIBLE", "")
        if forced in ("0", "1"):
            return forced == "0"
        isatty = getattr(self.file, "isatty", None)
        try:
            return not (isatty is not None and isatty())
        except ValueError:
            return True

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Print at a terminal with word wrapping; piped, unwrapped and without trailing spaces."""
        kwargs.setdefault("crop", False)  # a table wider than the terminal (--wide) is not cut
        if not self.piped:
            # lines wrap between words; a line holding a word (a path) longer than the terminal
            # is left to the terminal rather than broken inside that word
            kwargs.setdefault("soft_wrap", _longest_word(objects) > self.width)
            super().print(*objects, **kwargs)
            return
        buffer = io.StringIO()
        color = self.color_system
        plain = SafeConsole(
            file=buffer,
            width=PIPED_WIDTH,
            force_terminal=color is not None,
            color_system=color,  # type: ignore[arg-type]
            no_color=self.no_color,
            highlight=False,
            markup=self._markup,
            emoji=self._emoji,
            legacy_windows=False,
        )
        kwargs["soft_wrap"] = True
        plain.print(*objects, **kwargs)
        text = "\n".join(line.rstrip() for line in buffer.getvalue().split("\n"))
        self.file.write(text)
        self.file.flush()


def _longest_word(objects: Sequence[Any]) -> int:
    """The widest word of the strings and Texts among `objects` (0 if none)."""
    from rich.cells import cell_len

    words = (
        word
        for o in objects
        if isinstance(o, (str, Text))
        for word in (o.plain if isinstance(o, Text) else o).split()
    )
    return max((cell_len(printable(word)) for word in words), default=0)


# ------------------------------------------------------------ words and numbers
def count(n: int, singular: str, plural: str | None = None) -> str:
    """`1 trajectory`, `3 trajectories`, `12000 samples` (digits never grouped: they grep and parse)."""
    word = singular if n == 1 else (plural if plural is not None else singular + "s")
    return f"{n} {word}"


def size(n: int | None) -> str:
    """A byte count in IEC units: `512 B`, `96.7 KiB`, `1.2 GiB` (`-` when unknown)."""
    if n is None or n < 0:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def number(value: float | None) -> str:
    """A number with 4 significant digits: 0.5, 0.125, 1e-06, 1.235e+05 (`-` when unknown)."""
    if value is None:
        return "-"
    return f"{value:.4g}"


def head(items: Any, limit: int | None) -> Any:
    """The first `limit` items of a list, numpy array or lazy column (all of them when None)."""
    return items if limit is None or len(items) <= limit else items[:limit]


def left_out(items: Any, limit: int | None) -> int:
    """How many items `head(items, limit)` leaves out."""
    return 0 if limit is None else max(0, len(items) - limit)


def id_ranges(ids: Any) -> list[list[int]]:
    """Runs of consecutive ids, in list order, as [first, last] pairs: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    import numpy as np

    values = np.asarray(ids, dtype=np.int64).reshape(-1)
    if values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [values.size - 1]))
    return np.stack((values[starts], values[ends]), axis=1).tolist()  # type: ignore[no-any-return]


def id_runs(ids: Sequence[int] | Any, limit: int | None = None) -> str:
    """Ids as runs of consecutive ids, `0-4, 7, 9-12`; past `limit` runs, how many ids remain."""
    if not len(ids):
        return "(none)"
    runs = id_ranges(ids)
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in head(runs, limit))
    hidden = left_out(runs, limit)
    if hidden:
        rest = sum(b - a + 1 for a, b in runs[len(runs) - hidden :])
        shown += f", ... {count(rest, 'more id')} in {count(hidden, 'run')}"
    return shown


def format_ids(ids: Sequence[int], limit: int | None = None) -> str:
    """Ids for a person: runs of consecutive ids as `a-b`; past `limit` runs, how many ids remain."""
    return id_runs(ids, limit)


def files_line(files: dict[str, int]) -> str:
    """How trajectory files were placed, for a person."""
    placed = (
        f"{files['reflinked']} reflinked, {files['linked']} linked, "
        f"{files['copied']} copied, {files['written']} written"
    )
    return f"{placed}, {size(files['bytes'])}"


def unique_prefixes(ids: Iterable[str], shortest: int = ID_PREFIX) -> dict[str, str]:
    """Each id shortened to the shortest common length (at least `shortest`) at which distinct ids
    still differ; a shortened id ends in `…`. Ids that share a long prefix keep enough to tell apart."""
    distinct = sorted(set(ids))
    length = shortest
    # Neighbours in sorted order share the longest prefixes: the length that separates every
    # pair of neighbours separates every pair.
    for a, b in itertools.pairwise(distinct):
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        length = max(length, common + 1)
    return {i: i if len(i) <= length else i[:length] + "…" for i in distinct}


# ------------------------------------------------------------ tables
@dataclass(frozen=True)
class Column:
    """A table column. `drop` > 0: may be left out at a narrow terminal, highest first.
    `wrap`: long text (messages) that may wrap at spaces, never inside a word (a file name is
    never broken across lines: columns are left out instead); other columns never wrap or cut."""

    header: str
    right: bool = False
    drop: int = 0
    wrap: bool = False
    style: str = ""


class Fitted:
    """A table in rbtool's one style that fits the width it is drawn at.

    Numbers, dtypes and names are never cut: when the table is wider than the terminal, its
    droppable columns are left out (highest `drop` first) and a note names them. `wide`
    keeps every column (the terminal then wraps long lines).
    """

    def __init__(
        self,
        columns: Sequence[Column],
        rows: Sequence[Sequence[str | Text]],
        *,
        title: str | Text | None = None,
        caption: str | Text | None = None,
        header: bool = True,
        wide: bool = False,
        hint: str = "--wide shows them",
    ) -> None:
        self.columns = list(columns)
        self.rows = [[as_text(cell) for cell in r] for r in rows]  # names escaped, never markup
        self.title = None if title is None else plain(title)
        self.caption = None if caption is None else plain(caption)
        self.header = header
        self.wide = wide
        self.hint = hint
        self.dropped: list[str] = []

    def table(self, keep: Sequence[int]) -> Table:
        table = Table(
            box=box.SIMPLE_HEAD if self.header else None,
            show_header=self.header,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1),
        )
        for i in keep:
            col = self.columns[i]
            table.add_column(
                col.header,
                justify="right" if col.right else "left",
                no_wrap=not col.wrap,
                overflow="fold",
                style=col.style or None,
            )
        for row in self.rows:
            table.add_row(*(row[i] for i in keep))
        return table

    def need(self, console: Console, keep: Sequence[int]) -> int:
        """The narrowest the table over `keep` can be drawn without cutting: every cell of a
        non-wrapping column whole, wrapping columns down to their longest word (whole)."""
        table = self.table(keep)
        options = console.options.update(width=PIPED_WIDTH)
        total = Measurement.get(console, options, table).maximum
        for i in keep:
            if self.columns[i].wrap:
                cells = [Text(self.columns[i].header), *(as_text(row[i]) for row in self.rows)]
                widest = max(cell.cell_len for cell in cells)
                word = max((len(w) for cell in cells for w in cell.plain.split()), default=0)
                total -= widest - min(widest, word)
        return total

    def fitted(self, console: Console, width: int | None) -> tuple[Table, int]:
        """The table with the columns that fit `width` (all of them with no width or `wide`), and
        the width it needs."""
        keep = list(range(len(self.columns)))
        self.dropped = []
        need = self.need(console, keep)
        if width is not None and not self.wide:
            order = sorted((c.drop, i) for i, c in enumerate(self.columns) if c.drop > 0)
            while need > width and order:
                _, i = order.pop()
                keep.remove(i)
                self.dropped.append(self.columns[i].header or "(bar)")
                need = self.need(console, keep)
        return self.table(keep), need

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        """As wide as the fitted table needs, at most as wide as its widest line (so a grid of
        tables, as in `sample`, sets them side by side at their own widths)."""
        width = None if isinstance(console, ResultConsole) and console.piped else options.max_width
        table, need = self.fitted(console, width)
        widest = Measurement.get(console, options.update(width=PIPED_WIDTH), table).maximum
        for line in (self.title, self.caption):
            if line is not None:
                widest = max(widest, plain(line).cell_len)
        return Measurement(min(need, widest), widest)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Piped, the result console draws on a console PIPED_WIDTH wide: nothing is left out.
        width = None if isinstance(console, ResultConsole) and console.piped else options.max_width
        table, need = self.fitted(console, width)
        if self.title is not None:  # above the table, as wide as the terminal (not the table)
            yield unbroken(self.title, options.max_width)
        yield from console.render(table, options.update(width=max(options.max_width, need)))
        if self.caption is not None:  # under the table, as wide as the terminal (not the table)
            yield unbroken(self.caption, options.max_width)
        if self.dropped:
            yield Text(f"(left out to fit {width} columns: {', '.join(self.dropped)}; {self.hint})")


def as_text(cell: str | Text) -> Text:
    """A cell as Rich draws it: a str is plain text (names may hold `[`), never markup; control
    characters, newlines and tabs escaped (a cell is one value on one line)."""
    return printable_text(cell) if isinstance(cell, Text) else Text(printable(cell))


def plain(text: str | Text) -> Text:
    """A title or caption: a str is plain text (paths may hold `[`), never markup; control
    characters escaped."""
    return as_text(text)


def unbroken(text: Text, width: int) -> Text:
    """`text` to draw `width` wide: wrapped between words, or not at all when a word (a path)
    is wider than that (the terminal then wraps the line; the word is never broken)."""
    if _longest_word([text]) <= width:
        return text
    whole = text.copy()
    whole.no_wrap, whole.overflow = True, "ignore"
    return whole


def key_values(title: str | Text, rows: Sequence[tuple[str, str | Text]]) -> Fitted:
    """A two-column table of labelled values in the same style (no header)."""
    cells = [(plain(key), plain(value)) for key, value in rows]
    return Fitted([Column("key", style="bold"), Column("value", wrap=True)], cells, title=title, header=False)


def state_table(title: str, rows: list[tuple[str, dict[str, Any]]], limit: int | None = None) -> Fitted:
    """A table of (label, state) rows: size, samples, counter and ids of each (the first `limit` runs)."""
    columns = [
        Column("", style="bold"),
        Column("size", right=True),
        Column("total samples", right=True),
        Column("counter", right=True),
        Column("trajectory ids", wrap=True),
    ]
    cells = [
        [
            label,
            f"{state['size']}",
            f"{state['total_samples']}",
            f"{state['trajectory_counter']}",
            format_ids(state["trajectory_id_list"], limit),
        ]
        for label, state in rows
    ]
    return Fitted(columns, cells, title=title)


def side_by_side(*parts: RenderableType) -> Table:
    """Renderables in one row, 4 columns apart (callers check the width first)."""
    grid = Table.grid(padding=(0, 4))
    grid.add_row(*parts)
    return grid


def verdict(ok: bool, text: str) -> Text:
    """The first line of a checked path's report: `OK` (green) or `FAILED` (bold red), then `text`."""
    line = Text("OK" if ok else "FAILED", style="green" if ok else "bold red")
    line.append(text)
    return line


def more_note(kinds: Iterable[str], noun: str) -> str:
    """Under a table cut to its first rows: `... and N more (kind xK, ...); --all lists every NOUN`."""
    by_kind = Counter(kinds)
    shown = ", ".join(f"{kind} x{n}" for kind, n in by_kind.most_common())
    return f"... and {by_kind.total()} more ({shown}); --all lists every {noun}"


def check_table(names: Sequence[str], drops: tuple[int, int], rows: list[list[Any]]) -> Fitted:
    """The table under a checked path's first line: level, kind, ids (right-aligned) and a
    wrapped message, headed `names`; `drops` says in which order a narrow terminal leaves
    out the kind and ids columns."""
    level, kind, ids, message = names
    columns = [
        Column(level),
        Column(kind, drop=drops[0]),
        Column(ids, right=True, drop=drops[1]),
        Column(message, wrap=True),
    ]
    return Fitted(columns, rows, hint="piped output and --json keep them")
