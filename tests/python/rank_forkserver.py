"""Test ranks forked from pre-imported interpreters instead of started cold.

Note [Rank fork servers]
A rank process spends most of its start-up importing torch: ~2.4 s of CPU under torch
2.15 (1.0 s under 1.13), which on 2 cores made up about half of the Python suite's wall
time. `conftest.run_ranks` therefore asks a fork server for rank slot r (one server
process per slot, started on first use and kept for the session) to fork a child that
runs the rank's script. The server has imported torch and nothing of smp, and has run no
torch operation, so it holds no threads to lose in the fork and no smp state to leak.

What a child gets is what a fresh `python script.py` gets: the rank's environment,
working directory, argv and sys.path[0]; stdout and stderr into files; `__main__`
semantics (runpy); uncaught exceptions through sys.excepthook, exit status 1;
sys.last_value set for atexit handlers; SystemExit's code; non-daemon threads joined and atexit handlers run at exit; an exit by
signal reported as -signal, as subprocess does. Python's and numpy's global random
generators are reseeded (a fork would share them). Each slot is its own server so that
ranks keep different string hash seeds, as fresh processes have: an smp bug that orders
something by set iteration still shows up as ranks disagreeing.

Only variables read when torch or Python start (PYTHON*, OMP_*, MKL_*, OPENBLAS_*, LD_*,
KMP_*, GOMP_*, MALLOC_*) cannot change after the fork: a rank whose environment differs
from the server's in one of them starts cold instead, as does every rank when
SMP_TEST_FRESH_PROCESSES=1.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = []

# Environment variables consumed at interpreter or torch start-up.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "LD_", "KMP_", "GOMP_", "MALLOC_")


def startup_env(env):
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


# --- server side (this file run as a program) -------------------------------------------

def _run_child(req):
    """In the forked child: becomes `python script args` with the request's environment."""
    import atexit
    import random
    import runpy
    import threading
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        runpy.run_path(req["argv"][0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        # As the interpreter's top level (PyErr_Print) does: atexit handlers read these.
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # what interpreter exit does: join non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _serve(fd):
    import select
    import torch  # noqa: F401  (the import every rank would pay for)
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    conn = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buf = b""
    send = lambda msg: conn.sendall((json.dumps(msg) + "\n").encode())
    send({"ready": os.getpid()})
    while True:
        ready, _, _ = select.select([conn, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap every exited child
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if conn in ready:
            data = conn.recv(1 << 20)
            if not data:  # the test session ended
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_child(req)
                send({"pid": pid})


# --- client side (pytest) ---------------------------------------------------------------

class ForkedRank:
    """The part of subprocess.Popen that run_ranks uses, for a rank forked by a server."""

    def __init__(self, server, pid, out_path, err_path):
        self._server, self.pid = server, pid
        self._paths = (out_path, err_path)
        self.returncode = None

    def _read(self):
        texts = []
        for p in self._paths:
            with open(p, "rb") as f:
                texts.append(f.read().decode(errors="replace"))
            os.unlink(p)
        return texts

    def communicate(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
        return tuple(self._read())

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """One pre-imported interpreter that forks the ranks of one slot."""

    def __init__(self, python, env, start_timeout=180):
        ours, theirs = socket.socketpair()
        self._log = tempfile.NamedTemporaryFile(prefix="smp_forkserver_", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=self._log, cwd=tempfile.gettempdir())
        theirs.close()
        self.env = startup_env(env)
        self.output_dir = tempfile.mkdtemp(prefix="smp_ranks_")  # the ranks' stdout/stderr
        self._sock, self._buf, self._exits = ours, b"", {}
        msg = self._recv(time.monotonic() + start_timeout, "its start (importing torch)")
        assert "ready" in msg, msg

    def _recv(self, deadline, awaited):
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"fork server waiting for {awaited}", 0)
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(1 << 16)
            except socket.timeout:
                continue
            if not data:
                with open(self._log.name) as f:
                    log = f.read()[-3000:]
                raise RuntimeError(f"rank fork server exited while waiting for {awaited}:\n{log}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def spawn(self, argv, env, cwd, out_path, err_path):
        self._sock.sendall((json.dumps({"argv": [str(a) for a in argv], "env": env,
                                        "cwd": str(cwd), "stdout": str(out_path),
                                        "stderr": str(err_path)}) + "\n").encode())
        deadline = time.monotonic() + 60
        while True:
            msg = self._recv(deadline, "the pid of a forked rank")
            if "pid" in msg:
                return ForkedRank(self, msg["pid"], out_path, err_path)
            self._exits[msg["exit"]] = msg["code"]

    def wait(self, pid, timeout):
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while pid not in self._exits:
            msg = self._recv(deadline, f"the exit of forked rank {pid}")
            if "exit" in msg:
                self._exits[msg["exit"]] = msg["code"]
        return self._exits.pop(pid)

    def close(self):
        self._sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self._log.name)
        shutil.rmtree(self.output_dir, ignore_errors=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
