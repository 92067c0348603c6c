"""`rbtool` as a process that is lost in the middle of a journaled pass (run as a script).

`python tests/lose_rank.py ARGS...`, or the same script under torchrun, runs `rbtool ARGS...`;
with LOSE_RANK and LOSE_AFTER in the environment, the process of rank LOSE_RANK that journals
its LOSE_AFTER-th file leaves at once with status 17 (os._exit: no cleanup, no report, the
journal as it stands), as a node lost in the middle of a pass would. The hook is installed
when the script is imported, so worker processes carry it too: forked ones inherit it, and
spawned ones (or a fork server's) import the main script again.
"""

from __future__ import annotations

import os
from typing import Any

from rbtool.passes.journal import JournalWriter

LOST_STATUS = 17


def lose_after(rank: int, after: int) -> None:
    """Make the process of `rank` leave once it has journaled `after` files (of one journal)."""
    record = JournalWriter.record
    written: dict[str, int] = {}

    def record_then_leave(self: JournalWriter, *args: Any, **kwargs: Any) -> None:
        record(self, *args, **kwargs)
        if self.rank == rank:
            where = str(self.journal.directory)
            written[where] = written.get(where, 0) + 1
            if written[where] >= after:
                os._exit(LOST_STATUS)

    JournalWriter.record = record_then_leave  # type: ignore[method-assign]


if "LOSE_RANK" in os.environ:
    lose_after(int(os.environ["LOSE_RANK"]), int(os.environ.get("LOSE_AFTER", "1")))

if __name__ == "__main__":
    from rbtool.cli import main

    main()
