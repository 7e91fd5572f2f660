"""Whether a process that named a temporary file is still running (for cleaning up after
killed builds and saves)."""

from __future__ import annotations

import os


def pid_gone(pid: int) -> bool:
    """True when no process ``pid`` exists here; a process of another user counts as alive."""
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False
