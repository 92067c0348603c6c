"""The command line's consoles and the shared options that shape what they print.

Results go to stdout (see _output.ResultConsole); progress, warnings and errors to stderr.
Both escape control characters and read no markup (_output.SafeConsole): names are shown,
never acted on by the terminal. `settings` holds the values of the options every command
takes (-q, -v, --no-progress, --color; declared and recorded by `_app`), and the lines for a
person on stderr follow them.
"""

from __future__ import annotations

import enum
import os
from typing import Any

from rich.console import Console

from rbtool.cli._output import ResultConsole, SafeConsole

out = ResultConsole(highlight=False)
err = SafeConsole(stderr=True, highlight=False, soft_wrap=True)


class ColorMode(str, enum.Enum):
    """When output carries colour and style escape codes."""

    auto = "auto"
    always = "always"
    never = "never"


class Settings:
    """The shared options of the running command line: what was given, and where from."""

    def __init__(self) -> None:
        self.given: dict[str, Any] = {}  # on the command line (the last occurrence wins)
        self.environment: dict[str, Any] = {}  # from RBTOOL_* variables

    def _value(self, name: str, default: Any) -> Any:
        return self.given.get(name, self.environment.get(name, default))

    @property
    def quiet(self) -> bool:
        if "verbose" in self.given and "quiet" not in self.given:
            return False
        return bool(self._value("quiet", False))

    @property
    def verbose(self) -> bool:
        if "quiet" in self.given and "verbose" not in self.given:
            return False
        return bool(self._value("verbose", False)) and not self.quiet

    @property
    def progress(self) -> bool:
        return not self._value("no_progress", False) and not self.quiet

    @property
    def color(self) -> ColorMode:
        return ColorMode(self._value("color", ColorMode.auto))


settings = Settings()

# The command line's long-lived Rich consoles; `configure_consoles` sets their colour.
_CONSOLES: tuple[Console, ...] = (out, err)


def _set_color(console: Console) -> None:
    # Rich fixes a console's colour system when the console is made, at import time; the
    # mode (and NO_COLOR / FORCE_COLOR) is known only once the command line is parsed.
    from rich.color import ColorSystem

    mode = settings.color
    if mode is ColorMode.auto and os.environ.get("NO_COLOR", ""):
        mode = ColorMode.never
    if mode is ColorMode.never:
        console._color_system = None
    else:
        detected = console._detect_color_system()  # honours FORCE_COLOR, TERM, COLORTERM
        console._color_system = (detected or ColorSystem.STANDARD) if mode is ColorMode.always else detected
    console.no_color = mode is ColorMode.never


def configure_consoles() -> None:
    """Apply the colour mode to every console of the command line."""
    for console in _CONSOLES:
        _set_color(console)


def note(message: str) -> None:
    """A line for a person on stderr (what the command is waiting for, what it kept); none with -q."""
    if not settings.quiet:
        err.print(message, markup=False, highlight=False)


def progress_line(message: str, bar_shown: bool) -> None:
    """A line of progress on stderr (a published batch): the log's form of a progress bar, so none
    beside a bar, with -q or with --no-progress; always with -v."""
    if settings.verbose or (settings.progress and not bar_shown):
        err.print(message, markup=False, highlight=False)


def detail(message: str) -> None:
    """A line of detail on stderr (phases, timings), only with -v."""
    if settings.verbose:
        err.print(message, markup=False, highlight=False)
