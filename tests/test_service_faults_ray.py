"""Faults through real Ray Serve (its gRPC proxy, real replicas), a real redis-server the launcher starts
and real gRPC clients over loopback (issue 34): a killed ingress replica, health while no verifier
serves, client cancels, a hung drafter replica. What each one measured is printed (pytest -s)."""

import os
import random
import signal
import tempfile
import threading
import time

import grpc
import pytest
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.client import GenerationClient
from dflash.service.config import ServiceConfig
from dflash.service.redis_process import free_port
from dflash.service.session_store import CANCELLED, RedisSessionStore
from service_fixtures import assert_lost_stream, model_dirs, wait_until  # noqa: F401

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["def f(x):\n    return", "import os\nprint(", "a = [1, 2, 3]\nb =", "class a:\n    def"]
ACTOR = {"num_cpus": 0.1}
TOKEN = "s3cret-token"
PORT = free_port()


def config_tree(model_dirs, redis_url, mode="colocated", **extra):  # noqa: F811
    target, drafter = model_dirs
    tree = {
        # The ingress as a deployment of its own: its loss (below) is one of the faults.
        "mode": mode, "ingress_placement": "separate", "grpc_port": PORT, "torch_threads": 1, "auth_token": TOKEN,
        "trace_dir": tempfile.mkdtemp(prefix="dflash-spans-"),
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "redis": {"url": redis_url},
        "ingress": {"ray_actor_options": ACTOR},
        "verifier": {"ray_actor_options": ACTOR, "max_ongoing_requests": 32, "max_queued_requests": -1},
        "drafter": {"ray_actor_options": ACTOR, "num_replicas": 2},
        "drafter_net": {"retry_after_s": 0.5, "timeout_s": 10.0},
        "scheduler": {"verify_policy": "full", "pipeline_drafts": "on"},  # drafting beside verification
    }
    tree.update(extra)
    return ServiceConfig.from_dict(tree)


@pytest.fixture(scope="module")
def service(model_dirs):  # noqa: F811
    from dflash.service.launcher import start_local

    svc = start_local(config_tree(model_dirs, ""), num_cpus=2)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def reference(model_dirs):  # noqa: F811
    return build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def store(service):
    return RedisSessionStore(service.config.redis.url)


def want(reference, prompt, n):
    return reference.run(reference.encode(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids


def resume_until_served(client, session, received, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return [t for c in client.resume(session, received) for t in c.token_ids]
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def replica_actor(deployment: str):
    """The live replica actor of `deployment` (the application's one replica)."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f":{deployment}:" in actor["name"] or actor["name"].endswith(f"#{deployment}") or \
                f"#{deployment}#" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no {deployment} replica")


def replica_pid(deployment: str) -> int:
    return ray.get(replica_actor(deployment).__ray_call__.remote(lambda _: os.getpid()), timeout=60)


def watch_status(store, session, status, timeout_s=60.0) -> list:
    """From now on, poll the session's record in a thread: the list gets (when, record) once its status
    is `status`."""
    seen = []

    def poll():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = store.get(session)
            if record is not None and record.status == status:
                seen.extend((time.monotonic(), record))
                return
            time.sleep(0.02)

    threading.Thread(target=poll, daemon=True).start()
    return seen


def health(address, timeout_s=5.0):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_a_killed_ingress_is_reported_and_the_stream_resumes(service, reference, store):
    """SIGKILL the ingress replica mid-stream: the client gets UNAVAILABLE with the resume hint and no Ray
    internals (behind HAProxy, the default where it is installed: the stream reset, CANCELLED); health
    answers (never DEADLINE_EXCEEDED) until the replacement serves; the verifier's stream for the
    vanished client stops (its session is cancelled, far short of max_new_tokens); the client resumes
    exactly."""
    n = 220
    received, session, killed_at = [], None, None
    with GenerationClient(service.address, token=TOKEN, timeout_s=120) as client:
        with pytest.raises(grpc.RpcError) as lost:
            for chunk in client.generate(prompt=PROMPTS[0], max_new_tokens=n, ignore_eos=True):
                session = session or chunk.session_id
                received += chunk.token_ids
                if len(received) >= 8 and killed_at is None:
                    os.kill(replica_pid("ingress"), signal.SIGKILL)
                    killed_at = time.monotonic()
                    stopped = watch_status(store, session, CANCELLED)
        details = lost.value.details()
        assert killed_at is not None, (lost.value.code(), details)
        unavailable_s = time.monotonic() - killed_at
        assert_lost_stream(lost.value, service.config.ingress_proxy)

        # health: every check answers, within its deadline, until the new replica serves
        checks, slowest = [], 0.0
        while True:
            t0 = time.monotonic()
            checks.append(health(service.address, timeout_s=5.0))
            slowest = max(slowest, time.monotonic() - t0)
            if checks[-1] == "SERVING" and len(checks) > 1:
                break
            assert time.monotonic() - killed_at < 120, checks
            time.sleep(0.2)
        serving_again_s = time.monotonic() - killed_at

        wait_until(lambda: stopped, 30, "the orphaned stream's session to be cancelled")
        orphan_s, record = stopped[0] - killed_at, stopped[1]
        assert len(record.output_ids) < n
        rest = resume_until_served(client, session, len(received))
    assert received + rest == want(reference, PROMPTS[0], n)
    print(f"\nkilled ingress: {lost.value.code().name} after {unavailable_s:.2f} s; health "
          f"{checks.count('NOT_SERVING')} x "
          f"NOT_SERVING, slowest check {slowest:.2f} s, SERVING again after {serving_again_s:.1f} s; the orphaned "
          f"stream was cancelled {orphan_s:.2f} s after the kill, at {len(record.output_ids)}/{n} tokens")


def served_now(address, prompt=PROMPTS[1]):
    """A Generate right now completes (8 tokens, within 30 s)."""
    with GenerationClient(address, token=TOKEN, timeout_s=30) as client:
        chunks = list(client.generate(prompt=prompt, max_new_tokens=8, ignore_eos=True))
    return chunks[-1].final.usage.completion_tokens == 8


def poll_health(address, until, timeout_s=180.0):
    """(seconds since the start, status or the RpcError's code) every 0.2 s until `until(status)`."""
    t0, seen = time.monotonic(), []
    while time.monotonic() - t0 < timeout_s:
        try:
            status = health(address, timeout_s=5.0)
        except grpc.RpcError as exc:
            status = exc.code().name
        seen.append((time.monotonic() - t0, status))
        if until(status):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"health never reached the state wanted: {seen[-5:]}")


def test_health_is_serving_only_while_a_verifier_serves(service, model_dirs):  # noqa: F811
    """Health means a Generate would be served now: the verifier killed, health turns NOT_SERVING within
    the lease (3 s) and SERVING once the replacement serves; the application deployed again from nothing,
    NOT_SERVING while the verifier loads, and a Generate is served at the first SERVING."""
    from dflash.service.health import LEASE_TTL_S
    from ray import serve

    assert health(service.address) == "SERVING"
    killed_at = time.monotonic()
    ray.kill(replica_actor("verifier"), no_restart=True)
    down = poll_health(service.address, lambda s: s == "NOT_SERVING")
    not_serving_after_s = time.monotonic() - killed_at
    assert not_serving_after_s < LEASE_TTL_S + 2.0, down
    up = poll_health(service.address, lambda s: s == "SERVING")
    assert served_now(service.address)
    print(f"\nverifier killed: NOT_SERVING after {not_serving_after_s:.2f} s, SERVING again after "
          f"{time.monotonic() - killed_at:.1f} s ({len(up)} checks), and served at once")

    serve.delete(service.config.app_name)
    deploying = threading.Thread(target=service.deploy, args=(service.config,))
    deploying.start()
    seen = poll_health(service.address, lambda s: s == "SERVING")
    assert served_now(service.address)
    deploying.join(300)
    answered = [s for _, s in seen if s in ("SERVING", "NOT_SERVING")]
    assert "NOT_SERVING" in answered, seen  # the ingress answered before the verifier had loaded
    first = next(t for t, s in seen if s == "NOT_SERVING")
    print(f"deployed from nothing: NOT_SERVING for {seen[-1][0] - first:.1f} s while the verifier loaded, "
          f"then SERVING and served at once")


def ray_metric(name: str, labels: dict[str, str] | None = None) -> float | None:
    """A metric's value summed over Ray's Prometheus endpoints (ray.nodes()' MetricsExportPort; the
    replicas' ray.util.metrics arrive there within Ray's report interval); None when not exported yet."""
    import urllib.request

    total, found = 0.0, False
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                    timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("#") or not line.split("{")[0].split(" ")[0].endswith(name):
                    continue
                if all(f'{k}="{v}"' in line for k, v in (labels or {}).items()):
                    total, found = total + float(line.rsplit(" ", 1)[1]), True
    return total if found else None


def drafter_hot_sessions(app_name: str) -> float:
    from dflash.service.autoscaling import HOT_SESSIONS
    from ray import serve

    handle = serve.get_deployment_handle("drafter", app_name)
    return handle.record_autoscaling_stats.remote().result(timeout_s=30)[HOT_SESSIONS]


REPORT_S = 12  # longer than Ray's metrics report interval (metrics_report_interval_ms, 10 s)


def session_ids(store) -> set[str]:
    """Every session the store holds (the hashes, not their :out token strings)."""
    prefix = f"{store.prefix}:s:"
    return {k.decode()[len(prefix):] for k in store.redis.scan_iter(f"{prefix}*") if not k.endswith(b":out")}


def test_every_cancel_reaches_the_engine(service, model_dirs, store):  # noqa: F811
    """16 streams cancelled by their clients at random points (before the first chunk, after 1 to 6
    chunks): every session they opened ends cancelled (in the store and in dflash_requests_total), none
    runs to its end, and the engine's running batch and the drafter replica's draft caches are empty
    afterwards. (A cancel that lands before the ingress has forwarded the call opens no session.)"""
    n, streams = 200, 16
    service.deploy(config_tree(model_dirs, service.config.redis.url, "disaggregated",
                               drafter={"ray_actor_options": ACTOR, "num_replicas": 1}))
    with GenerationClient(service.address, token=TOKEN, timeout_s=120) as client:  # warm: the metric exists
        list(client.generate(prompt=PROMPTS[2], max_new_tokens=8, ignore_eos=True))

    def counted(status):
        return ray_metric("dflash_requests_total", {"status": status}) or 0.0

    wait_until(lambda: counted("finished"), 60, "Ray to export the verifier's metrics", interval_s=1.0)

    def settled():  # the same counts over more than one report interval (Ray's is 10 s): nothing on its way
        first = {status: counted(status) for status in ("finished", "cancelled", "failed")}
        time.sleep(REPORT_S)
        return first if first == {status: counted(status) for status in first} else None

    before = wait_until(settled, 60, "the request counts to settle", interval_s=0)
    sessions_before = session_ids(store)
    rng = random.Random(34)
    points = [rng.randint(0, 6) for _ in range(streams)]
    waits = [rng.random() * 0.05 for _ in range(streams)]
    sessions, at_cancel, errors = [None] * streams, [0] * streams, []

    def one(i):
        with GenerationClient(service.address, token=TOKEN, timeout_s=120) as client:
            call = client.generate(prompt=PROMPTS[i % 4], max_new_tokens=n, ignore_eos=True)
            try:
                if points[i] == 0:
                    time.sleep(waits[i])
                else:
                    for k, chunk in enumerate(call, 1):
                        sessions[i] = chunk.session_id
                        at_cancel[i] += len(chunk.token_ids)
                        if k == points[i]:
                            break
                call.cancel()
                list(call)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    known = {s for s in sessions if s}
    opened = wait_until(lambda: (ids := session_ids(store) - sessions_before) >= known and ids, 30,
                        "the sessions to be in the store")
    records = wait_until(lambda: all((r := store.get(s)) is not None and r.status == CANCELLED for s in opened)
                         and [store.get(s) for s in opened], 30, "every opened session to be cancelled in the store")
    assert all(len(r.output_ids) < n for r in records)
    wait_until(lambda: counted("cancelled") - before["cancelled"] >= len(opened), 60,
               f"{len(opened)} more cancelled requests in dflash_requests_total", interval_s=1.0)
    time.sleep(REPORT_S)  # one more report interval: nothing else is counted late
    assert counted("cancelled") - before["cancelled"] == len(opened)
    assert counted("finished") == before["finished"] and counted("failed") == before["failed"]
    wait_until(lambda: ray_metric("dflash_running_sessions") == 0, 60, "the running batch to be empty", 1.0)
    wait_until(lambda: drafter_hot_sessions(service.config.app_name) == 0, 30, "the drafter's caches to be freed",
               1.0)
    after = [len(r.output_ids) - at_cancel[sessions.index(r.session_id)] for r in records if r.session_id in known]
    print(f"\n16 cancels ({points.count(0)} before the first chunk, {len(opened) - len(known)} of those opened a "
          f"session): all {len(opened)} sessions cancelled; tokens committed after the client's cancel: "
          f"max {max(after)}, median {sorted(after)[len(after) // 2]} (of {n})")


def pid_listening_on(address: str) -> int:
    import psutil

    host, port = address.rsplit(":", 1)
    for conn in psutil.net_connections(kind="tcp"):
        ip = conn.laddr.ip.removeprefix("::ffff:") if conn.laddr else ""  # gRPC listens on IPv4-mapped v6
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == int(port) and ip == host and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on {address}")


def test_a_hung_drafter_replica_holds_no_stream_for_its_timeout(service, model_dirs, reference, store):  # noqa: F811
    """One of two drafter replicas stopped (SIGSTOP: alive, silent) for 8 s under 8 streams: no stream
    waits anywhere near drafter_net.timeout_s (10 s here) for a chunk; the late replica's sessions decode
    plainly for that round and move to the other replica; every output is exact."""
    n, streams, stop_s = 200, 8, 6.0
    service.deploy(config_tree(model_dirs, service.config.redis.url, "disaggregated",
                               drafter={"ray_actor_options": ACTOR, "num_replicas": 2}))
    wait_until(lambda: len(store.drafters()) == 2, 60, "two drafter replicas advertised", interval_s=0.2)
    got, gaps, stopped = [[] for _ in range(streams)], [0.0] * streams, threading.Event()

    def one(i):
        with GenerationClient(service.address, token=TOKEN, timeout_s=120) as client:
            last = None
            for chunk in client.generate(prompt=PROMPTS[i % 4], max_new_tokens=n, ignore_eos=True,
                                         stream_interval_ms=0):
                now = time.monotonic()
                if last is not None and stopped.is_set():  # the gaps while the replica is stopped
                    gaps[i] = max(gaps[i], now - last)
                last = now
                got[i] += chunk.token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(g) >= 10 for g in got), 60, "every stream to be under way")
    victim = pid_listening_on(store.drafters()[0])
    os.kill(victim, signal.SIGSTOP)
    stopped.set()
    at_stop = [len(g) for g in got]
    try:
        time.sleep(stop_s)
    finally:
        stopped.clear()
        os.kill(victim, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert all(k < n for k in at_stop), at_stop  # the stop landed while every stream ran
    for i in range(streams):
        assert got[i] == want(reference, PROMPTS[i % 4], n), i
    print(f"\none of 2 drafter replicas stopped {stop_s:.0f} s: slowest gap between chunks {max(gaps):.2f} s "
          f"(drafter_net.timeout_s 10 s); outputs exact; tokens at the stop {at_stop}")
    assert max(gaps) < 3.0, gaps
