"""Run a command the way a person does: attached to a terminal (a pseudo-terminal), with a deadline.

A pipe hides what only happens on a TTY (progress bars, colour, isatty-dependent defaults); the
simulate command once hung exactly there. stdin, stdout and stderr all get the pty's slave
side, so ``sys.stderr.isatty()`` is true in the child, as in an interactive shell.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class TerminalRun:
    returncode: int | None  # None: killed at the deadline
    output: str  # stdout and stderr interleaved, as the terminal showed them
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_in_terminal(argv: Sequence[str], timeout: float, cwd: str | None = None, env: dict | None = None,
                    until: Callable[[str], bool] | None = None, then_send: bytes = b"") -> TerminalRun:
    """Run ``argv`` on a fresh pty. If ``until`` is given, type ``then_send`` (e.g. Ctrl-C) on the
    terminal once the output satisfies it. Kills the whole process group at ``timeout``."""
    master, slave = os.openpty()
    # a new pty is 0x0; tqdm sizes its bar to the terminal and would draw nothing at width 0
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    # a session of its own with the pty as controlling terminal, so Ctrl-C typed on it is a SIGINT
    # to the command's foreground process group, as in a shell
    proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                            start_new_session=True, close_fds=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    chunks: list[bytes] = []
    start = time.monotonic()
    sent = False
    returncode: int | None = None
    try:
        while True:
            if time.monotonic() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the slave side has exited
                    data = b""
                if not data:
                    returncode = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
                    break
                chunks.append(data)
            if until is not None and not sent and until(b"".join(chunks).decode(errors="replace")):
                os.write(master, then_send)
                sent = True
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return TerminalRun(returncode, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n"),
                       time.monotonic() - start)
