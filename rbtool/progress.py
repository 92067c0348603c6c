"""How long work reports progress: one callable, told how many units were just done.

Every library function that takes `progress` takes this; the command line passes a bar's
`advance`, tests a counter. Units are the function's own (trajectories, files, bytes) and
are said in its docstring.
"""

from collections.abc import Callable

Progress = Callable[[int], None]
