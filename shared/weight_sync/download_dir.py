"""Where a generator keeps the weight versions it downloads from the relay: a folder that several generators share
(every generator of a run has the same ``generator.weights_dir``, ``<run_dir>/generator/weights``).

Each receiver names its files after itself (``v<version>.<host>-<pid>-<n>.safetensors``) and deletes only those, so
one generator never renames, reads or deletes a file another is writing or loading; the files of a process on this
host that is gone (a generator killed mid-download) are deleted by the next one that clears the folder.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from pathlib import Path

_OWNED = re.compile(r"^v\d{10}\.(?P<owner>(?P<host>.+)-(?P<pid>\d+)-\d+)\.safetensors(\..+\.partial)?$")
_instances = itertools.count()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class DownloadDir:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.host = socket.gethostname()
        self.owner = f"{self.host}-{os.getpid()}-{next(_instances)}"

    def path_for(self, version: int) -> Path:
        """This receiver's file for ``version`` (the folder is created)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f"v{version:010d}.{self.owner}.safetensors"

    def clear(self) -> None:
        """Delete this receiver's files, and those a process of this host that no longer runs left behind."""
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            match = _OWNED.match(path.name)
            if match is None or match["host"] != self.host:
                continue
            if match["owner"] == self.owner or not _alive(int(match["pid"])):
                path.unlink(missing_ok=True)
