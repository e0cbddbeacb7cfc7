"""The redis-server that `dflash serve` starts: a generated password no command line shows, and a
supervisor that brings a killed server back (same directory, same port, AOF reloaded) by itself.

A real redis-server, real redis-py clients and the real session store; the service on Ray with the
same embedded Redis is checked in test_service_ray.py.
"""

import logging
import os
import signal
import stat
import time

import pytest
import redis
from dflash.service.messages import redact_credentials
from dflash.service.redis_process import RedisProcess, redis_server_path
from dflash.service.session_store import CommittedRound, RedisSessionStore, SessionRecord, StoreUnavailableError
from service_fixtures import wait_until

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(redis_server_path() is None, reason="redis-server is not installed")]


@pytest.fixture
def supervised(tmp_path):
    server = RedisProcess(tmp_path / "redis", supervise=True).start()
    yield server
    server.stop()


def command_lines() -> list[str]:
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return lines


def test_the_password_is_generated_and_on_no_command_line(supervised):
    password = supervised.password
    assert len(password) >= 32 and f":{password}@" in supervised.url
    assert stat.S_IMODE(supervised.config_file.stat().st_mode) == 0o600
    assert not any(password in line for line in command_lines())  # what `ps` shows, every process
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: no password, no data
        redis.Redis(host=supervised.host, port=supervised.port).get("x")
    assert redis.Redis.from_url(supervised.url).ping()
    assert password not in redact_credentials(supervised.url) and redact_credentials(supervised.url).startswith("redis://:***@")




def test_a_killed_server_comes_back_with_its_sessions(supervised, caplog):
    store = RedisSessionStore(supervised.url, socket_timeout_s=1.0)
    store.create(SessionRecord("kept", [1, 2], {}, seed=3))
    store.commit_rounds([CommittedRound("kept", 1, [4, 5, 6], 1)])
    first = supervised.process.pid
    with caplog.at_level(logging.WARNING, logger="dflash.service"):
        os.kill(first, signal.SIGKILL)  # a crash: no AOF flush on the way out
        with pytest.raises(StoreUnavailableError):
            store.get("kept")
        wait_until(lambda: supervised.restarts == 1, 20, "the supervisor to restart redis-server")
    assert supervised.process.pid != first and supervised.port == store.redis.connection_pool.connection_kwargs["port"]
    assert store.get("kept").output_ids == [4, 5, 6]  # the same client reconnects; the AOF held the write
    restarts = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert len(restarts) == 1 and str(supervised.port) in restarts[0]
    assert supervised.password not in caplog.text


def test_a_stopped_server_stays_stopped_until_started(supervised):
    supervised.stop()
    time.sleep(1.0)
    assert supervised.process is None and supervised.restarts == 0
    supervised.start()
    assert redis.Redis.from_url(supervised.url).ping()
