"""Real ``mergekit-yaml`` processes without paying its start-up each time: forked from a warm parent.

``mergekit-yaml`` imports torch, transformers, peft and mergekit before it reads its config:
about 7 s of CPU per process on the 2-core test machine, far more than the tiny merges the
kill/stop tests run. Those tests need a real process (its own pid, lock and staging folder,
stopped by SIGSTOP and killed by SIGKILL), not a real start-up: that one is covered by the tests
that run the console script itself (``runners.run_process``).

:class:`WarmStarter` starts one interpreter of this environment (the graft hook installed by
``graftmerge_hook.pth`` as at any start-up) that imports mergekit-yaml's command module and then
waits. Each :meth:`WarmStarter.start` forks it; the child is what the console script would be
right after its imports: it takes the given environment (only variables read at run time, such as
``$GRAFTMERGE_TEST_STOP_AT`` and ``$GRAFTMERGE_CACHE_DIR``, can differ from the starter's), its
arguments and output files, and runs the console script's body. The starter is the child's parent,
so it waits for it and reports its stops and its exit status to :class:`WarmProcess`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The warm parent: one JSON request per stdin line, one JSON reply per stdout line.
STARTER = r'''
import json, os, re, signal, sys, traceback
import mergekit.scripts.run_yaml as script

def child(request):
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and path == request["stdout"]:
            os.dup2(1, 2)  # one file, one offset, as 2>&1
            continue
        opened = os.open(path, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [re.sub(r"(-script\.pyw|\.exe)?$", "", request["argv"][0]), *request["argv"][1:]]
    code = 0
    try:  # the console script's body: sys.exit(main())
        sys.exit(script.main())
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

replies = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but replies on the reply pipe
replies.write("ready\n")
replies.flush()
for line in sys.stdin:
    request = json.loads(line)
    if "argv" in request:
        pid = os.fork()
        if pid == 0:
            replies.close()
            child(request)
        reply = {"pid": pid}
    else:
        flags = (os.WNOHANG if request["nohang"] else 0) | (os.WUNTRACED if request["untraced"] else 0)
        try:
            waited, status = os.waitpid(request["wait"], flags)
            reply = {"pid": waited, "status": status}
        except ChildProcessError:
            reply = {"pid": -1, "status": 0}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
'''


class WarmStarter:
    """The warm parent of :class:`WarmProcess` children (one per test module or session; :meth:`close` it)."""

    def __init__(self, env: dict[str, str] | None = None):
        self._process = subprocess.Popen([sys.executable, "-c", STARTER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)
        ready = self._process.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the warm mergekit-yaml parent did not start ({ready!r})")

    def request(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return json.loads(self._process.stdout.readline())

    def start(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
              stdout: Path | None = None, stderr: Path | None = None) -> WarmProcess:
        """``mergekit-yaml ARGS`` as a forked child; its output to the files (both to ``stderr``'s
        if only that is given), or discarded."""
        discard = os.devnull
        reply = self.request({
            "argv": ["mergekit-yaml", *map(str, args)], "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
            "stdout": str(stdout or stderr or discard), "stderr": str(stderr or stdout or discard),
        })
        return WarmProcess(self, reply["pid"])

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """``mergekit-yaml ARGS`` forked and waited for, like :func:`tests.helpers.runners.run_process`."""
        with tempfile.TemporaryDirectory(prefix="warm-run-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            process = self.start(*args, env=None if env is None else {**os.environ, **env}, stdout=out, stderr=err)
            try:
                process.wait(timeout)
            finally:
                process.kill()
            return subprocess.CompletedProcess(["mergekit-yaml", *args], process.returncode, out.read_text(),
                                               err.read_text())

    def close(self) -> None:
        """Ends the parent (killed: it holds nothing to save, and its interpreter's shutdown is slow)."""
        self._process.kill()
        self._process.wait(timeout=60)
        self._process.stdin.close()
        self._process.stdout.close()


class WarmProcess:
    """A forked mergekit-yaml: the parts of :class:`subprocess.Popen` the tests use, plus :meth:`wait_stopped`."""

    def __init__(self, starter: WarmStarter, pid: int):
        self._starter, self.pid, self.returncode = starter, pid, None

    def _wait(self, nohang: bool, untraced: bool = False) -> int | None:
        reply = self._starter.request({"wait": self.pid, "nohang": nohang, "untraced": untraced})
        return reply["status"] if reply["pid"] == self.pid else None

    def _finished(self, status: int | None) -> bool:
        if status is None or os.WIFSTOPPED(status):
            return False
        self.returncode = os.waitstatus_to_exitcode(status)
        return True

    def wait_stopped(self) -> bool:
        """Block until the child stops (True) or ends (False, returncode set)."""
        status = self._wait(nohang=False, untraced=True)
        if status is not None and os.WIFSTOPPED(status):
            return True
        self._finished(status)
        return False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._finished(self._wait(nohang=True))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"mergekit-yaml (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
