"""Start, find and stop the dev cluster's processes by pid, never by name.

Each process starts in a session (and process group) of its own, so stopping it also stops
whatever it forked; a pid file records the pid with the process's start time, so a pid the
kernel has since reused for something else is never signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PidRecord:
    """A process we started: enough to find it again and to be sure it is still ours."""

    name: str
    pid: int
    create_time: float
    argv: list[str]

    def is_alive(self) -> bool:
        """True while the recorded process (not a later one with the same pid) runs."""
        try:
            proc = psutil.Process(self.pid)
            return (
                abs(proc.create_time() - self.create_time) < 1.0
                and proc.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False


def write_record(path: Path, record: PidRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(path)


def read_record(path: Path) -> PidRecord | None:
    try:
        return PidRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[bytes], PidRecord]:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:  # exited at once: the record is still useful for its exit code
        create_time = 0.0
    logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
    return proc, PidRecord(name=name, pid=proc.pid, create_time=create_time, argv=list(argv))


def _signal_group(record: PidRecord, sig: signal.Signals) -> None:
    """Signal the record's process group (it leads one: start_new_session), else the pid alone."""
    try:
        os.killpg(record.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(record.pid, sig)
        except ProcessLookupError:
            pass


def terminate_group(record: PidRecord) -> None:
    """SIGTERM the record's group without waiting (to stop several at once, then `stop` each)."""
    if record.is_alive():
        _signal_group(record, signal.SIGTERM)


def group_members(record: PidRecord) -> list[psutil.Process]:
    """The live processes in the record's process group (itself and anything it forked)."""
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == record.pid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def stop(record: PidRecord, *, grace_s: float = 10.0) -> bool:
    """SIGTERM the record's process group, wait up to `grace_s`, then SIGKILL it.

    Returns True when it had to SIGKILL. A record whose process is gone (or whose pid now
    belongs to another process) is left alone, but stray members of its group are still killed.
    """
    killed = False
    if record.is_alive():
        _signal_group(record, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while record.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if record.is_alive():
            logger.warning(
                "%s (pid %d) ignored SIGTERM for %.0fs: SIGKILL", record.name, record.pid, grace_s
            )
            _signal_group(record, signal.SIGKILL)
            killed = True
    # Forked children may outlive their leader; the group id still names them.
    if record.create_time and group_members(record):
        _signal_group(record, signal.SIGKILL)
    return killed
