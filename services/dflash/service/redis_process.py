"""A redis-server child process on a free loopback port, with AOF on: for `dflash serve` and the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from ..errors import DFlashError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """Starts `redis-server` with its data (AOF, fsync every second) in `directory`; `restart` keeps the data."""

    def __init__(self, directory: str | Path, port: int | None = None, host: str = "127.0.0.1"):
        self.binary = redis_server_path()
        if self.binary is None:
            raise DFlashError("redis-server is not installed (apt-get install redis-server)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisProcess":
        args = [
            self.binary, "--bind", self.host, "--port", str(self.port), "--dir", str(self.directory),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
            "--daemonize", "no", "--logfile", str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DFlashError(f"redis-server exited at start; see {self.directory / 'redis.log'}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise DFlashError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s}s")

    def stop(self) -> None:
        """SIGTERM: Redis flushes the AOF before it exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "RedisProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
