"""Files that one process writes and another reads while it runs (the live status a server's API
process serves, the engine limits a retrain replays on): replaced whole, never seen half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, then rename it over `path`: a
    rename within one directory (one filesystem) is atomic, so a reader opens the old file or the
    new one, never a partial write. The temporary name carries the process id, so two processes
    writing the same file (replicas sharing a log directory) never write into one temporary file;
    it is removed if the write fails."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
