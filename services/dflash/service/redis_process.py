"""A redis-server child process on a free loopback port, for `dflash serve` and the tests.

Its data (AOF on, fsync before each reply) lives in one directory, and so does its configuration:
`redis.conf`, mode 0600, holds everything including a generated password (`requirepass`), so the
password never appears on a command line that `ps` shows; `url` carries it to whoever connects.
With `supervise=True` a watcher thread restarts a redis-server that exits without `stop()` (killed,
crashed) in the same directory on the same port, so it reloads its AOF and clients reconnect by
themselves; each restart is logged.

fsync `always`, not `everysec`: with everysec Redis may postpone writing the AOF while a background
fsync runs yet still answer the client, so a killed server can come back without a step the engine
had already streamed, and that client could no longer resume. Measured here: one engine step's write
for 8 sessions takes 1.5 ms instead of 0.3 ms.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from ..errors import DFlashError

log = logging.getLogger("dflash.service")

RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # between failed restarts; the last repeats


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """Starts `redis-server` with its data and config in `directory`; `restart` keeps the data.

    password None generates one; "" runs without (tests of the unauthenticated case only).
    """

    def __init__(self, directory: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 password: str | None = None, supervise: bool = False) -> None:
        self.binary = redis_server_path()
        if self.binary is None:
            raise DFlashError("redis-server is not installed (apt-get install redis-server)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port(host)
        self.password = secrets.token_urlsafe(32) if password is None else password
        self.supervise = supervise
        self.process: subprocess.Popen | None = None
        self.restarts = 0  # by the supervisor
        self._lock = threading.Lock()
        self._wanted = False  # between start() and stop(): the supervisor brings it back if it exits
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def config_file(self) -> Path:
        return self.directory / "redis.conf"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        with self._lock:
            self._launch(timeout_s)
            self._wanted = True
        if self.supervise and (self._watcher is None or not self._watcher.is_alive()):
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="redis-supervisor")
            self._watcher.start()
        return self

    def stop(self) -> None:
        """SIGTERM: Redis flushes the AOF before it exits. A stopped server is not restarted."""
        with self._lock:
            self._wanted = False
            self._terminate()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ----------------------------------------------------------------------------------

    def _write_config(self) -> None:
        lines = [
            f"bind {self.host}", f"port {self.port}", f'dir "{self.directory}"', "appendonly yes",
            "appendfsync always", 'save ""', "protected-mode yes", "daemonize no",
            f'logfile "{self.log_file}"',
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(self.config_file, 0o600)  # an existing file keeps its mode through O_CREAT

    def _launch(self, timeout_s: float) -> None:
        self._write_config()
        self.process = subprocess.Popen([self.binary, str(self.config_file)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DFlashError(f"redis-server exited at start; see {self.log_file}")
            if self._answers():
                return
            time.sleep(0.05)
        self._terminate()
        raise DFlashError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s}s")

    def _answers(self) -> bool:
        """AUTH (when there is a password) and PING over a raw socket; True on PONG."""
        request = b"*1\r\n$4\r\nPING\r\n"
        if self.password:
            pw = self.password.encode()
            request = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) + request
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(request)
                reply = b""
                while b"PONG" not in reply and b"-" not in reply[:1] and len(reply) < 64:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return b"+PONG" in reply
        except OSError:
            return False

    def _terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _watch(self) -> None:
        failures = 0
        while True:
            time.sleep(0.2)
            with self._lock:
                if not self._wanted:
                    return
                process = self.process
                if process is not None and process.poll() is None:
                    failures = 0
                    continue
                code = process.returncode if process is not None else None
                log.warning("redis-server on %s:%d (pid %s) exited with code %s; restarting it in %s (AOF)",
                            self.host, self.port, process.pid if process else "-", code, self.directory)
                try:
                    self._launch(timeout_s=10.0)
                except DFlashError as exc:
                    self.process = None
                    log.error("redis-server restart failed: %s", exc)
                else:
                    self.restarts += 1
                    log.warning("redis-server on %s:%d restarted (pid %d, restart %d); sessions reloaded from the "
                                "AOF", self.host, self.port, self.process.pid, self.restarts)
                    continue
            time.sleep(RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)])
            failures += 1
