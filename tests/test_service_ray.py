"""The service on real Ray Serve (gRPC proxy), real gRPC clients and a real redis-server, over loopback.

One Ray instance for the module (Ray on this 2-core machine costs tens of seconds to start), started
as `dflash serve` starts it: the launcher's own redis-server (generated password, supervised) and its
generated drafter token. The application is deployed co-located first, then disaggregated with two
drafter replicas. Every deployment requires a bearer token (checked by the ingress replica behind
Ray's proxy), and every replica writes its spans to a per-process JSON-lines file, so one request's
spans across processes can be checked.
"""

import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.client import GenerationClient
from dflash.service.config import ServiceConfig
from dflash.service.redis_process import free_port
from service_fixtures import assert_lost_stream, model_dirs, wait_until  # noqa: F401

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["def f(x):\n    return", "import os\nprint(", "a = [1, 2, 3]\nb =", "class a:\n    def"]
ACTOR = {"num_cpus": 0.1}
TOKEN = "s3cret-token"
TRACE_DIR = tempfile.mkdtemp(prefix="dflash-spans-")


def config_tree(model_dirs, redis_url, mode, **extra):
    target, drafter = model_dirs
    tree = {
        "mode": mode, "grpc_port": PORT, "torch_threads": 1, "auth_token": TOKEN, "trace_dir": TRACE_DIR,
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "redis": {"url": redis_url},
        "ingress": {"ray_actor_options": ACTOR},
        "verifier": {"ray_actor_options": ACTOR, "max_ongoing_requests": 8, "max_queued_requests": -1},
        "drafter": {"ray_actor_options": ACTOR, "num_replicas": 2},
        "drafter_net": {"retry_after_s": 0.5, "timeout_s": 5.0},
        # every proposal verified (drafting stays observable); in disaggregated mode drafted beside
        # verification (draft_pipeline.py), so the drafter-kill test runs on the pipelined path
        "scheduler": {"verify_policy": "full", "pipeline_drafts": "on"},
    }
    tree.update(extra)
    return ServiceConfig.from_dict(tree)


PORT = free_port()


START_ERROR = []  # pytest retries a failed module fixture for every test; Ray's start is too slow to retry


@pytest.fixture(scope="module")
def service(model_dirs):  # noqa: F811
    from dflash.service.launcher import start_local

    if START_ERROR:
        pytest.fail(f"the service did not start: {START_ERROR[0]}")
    try:  # redis.url "": the launcher starts its own redis-server, as `dflash serve` does
        svc = start_local(config_tree(model_dirs, "", "colocated"), num_cpus=2)
    except Exception as exc:
        START_ERROR.append(f"{type(exc).__name__}: {exc}")
        raise
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def reference(model_dirs):
    return build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")


@pytest.fixture
def client(service):
    with GenerationClient(service.address, token=TOKEN, timeout_s=120) as c:
        yield c


def want(reference, prompt, n=24):
    return reference.run(reference.encode(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids


def collect(stream):
    chunks = []
    for chunk in stream:
        chunks.append((time.monotonic(), chunk))
    return chunks


def tokens(chunks):
    return [t for _, c in chunks for t in c.token_ids]


def test_concurrent_clients_get_the_engines_tokens_incrementally(service, client, reference):
    results = {}

    def one(prompt):
        results[prompt] = collect(client.generate(prompt=prompt, max_new_tokens=24, ignore_eos=True))

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for prompt in PROMPTS:
        chunks = results[prompt]
        assert tokens(chunks) == want(reference, prompt)
        assert len(chunks) > 3 and chunks[-1][1].final.finish_reason == "length"
        assert chunks[-1][1].final.usage.completion_tokens == 24 and chunks[0][1].session_id
        assert chunks[-1][0] - chunks[0][0] > 0.01  # streamed round by round, not all at the end


@pytest.mark.parametrize("fields, named", [
    ({}, "prompt"), ({"prompt": "x", "temperature": -0.5}, "temperature"), ({"prompt": "x", "top_p": 2.0}, "top_p"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"), ({"prompt": "x" * 300}, "prompt"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(client, fields, named):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(named), err.value.details()


def test_health_is_open_and_reflection_follows_auth(service):
    """Health answers probes, which carry no token; reflection lists the API only to callers with it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(channel, metadata=()):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=60, metadata=metadata)
        return {s.name for s in answer.list_services_response.service}

    with grpc.insecure_channel(service.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                list_services(channel, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        names = list_services(channel, (("authorization", f"Bearer {TOKEN}"),))
        assert {"dflash.v1.Generation", "grpc.health.v1.Health"} <= names


def test_the_public_port_listens_on_the_configured_host_only(service):
    """grpc_host 127.0.0.1 (the default): Serve's gRPC proxy listens on loopback alone (Ray binds
    [::] unless the launcher's hook tells it otherwise), as do its HTTP proxy, Redis and the
    launcher's other ports; the port does not answer on this machine's other address."""
    import socket

    import psutil

    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    public = {c.laddr.ip for c in listening if c.laddr.port == service.config.grpc_port}
    assert public and public <= {"127.0.0.1", "::ffff:127.0.0.1"}, public
    node_ip = ray.util.get_node_ip_address()
    if not node_ip.startswith("127."):
        from dflash.service.launcher import check_listens_only_on

        with pytest.raises(OSError):
            socket.create_connection((node_ip, service.config.grpc_port), timeout=2).close()
        check_listens_only_on("127.0.0.1", service.config.grpc_port, node_ip)  # what start_local checked
    assert {c.laddr.ip for c in listening if c.laddr.port == service.redis.port} == {"127.0.0.1"}


def test_a_tiny_temperature_decodes_greedily(client, reference):
    chunks = collect(client.generate(prompt=PROMPTS[1], max_new_tokens=24, ignore_eos=True, temperature=1e-40))
    assert tokens(chunks) == want(reference, PROMPTS[1]) and chunks[-1][1].final.finish_reason == "length"


@pytest.mark.parametrize("session_id", ["x" * 100_000, "a b/c"], ids=["100KB", "bad-characters"])
def test_bad_session_ids_are_invalid_argument_without_an_echo(client, session_id):
    with pytest.raises(grpc.RpcError) as err:
        list(client.resume(session_id, 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("session_id: must be 1 to 128") and len(err.value.details()) < 200


@pytest.mark.parametrize("method, data", [
    ("/dflash.v1.Generation/Generate", b"\xff\xfe\xfd random"),
    ("/dflash.v1.Generation/Generate", b"\x0a\xff\xff\xff\xff\x0f"),  # a length past the end
    ("/dflash.v1.Generation/Generate", b"\x08"),  # a truncated varint
    ("/grpc.health.v1.Health/Check", b"\xff\xfe"),
], ids=["random", "length-past-the-end", "truncated-varint", "health"])
def test_malformed_protobuf_is_invalid_argument(service, method, data):
    """Ray's proxy decodes a request before routing it; registered by servicers.py, bytes it cannot
    decode reach the ingress, which answers INVALID_ARGUMENT (not UNKNOWN "Unexpected DecodeError")."""
    with grpc.insecure_channel(service.address) as channel:
        call = channel.unary_stream(method) if method.endswith("Generate") else channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as err:
            reply = call(data, timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")])
            list(reply) if method.endswith("Generate") else reply
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("request: not a valid ")


def test_replicas_run_at_the_configured_niceness(service):
    """Ray's default worker niceness (15) would leave the replicas below Ray's own processes."""
    import psutil

    replicas = [p for p in psutil.process_iter(["cmdline"]) if "ServeReplica" in " ".join(p.info["cmdline"] or ())]
    assert replicas and all(p.nice() == service.config.worker_niceness for p in replicas)


def test_the_embedded_redis_has_a_password_no_command_line_shows(service):
    import psutil
    import redis

    password = service.redis.password
    assert password and f":{password}@" in service.config.redis.url
    for process in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(process.info["cmdline"] or ()), process.pid
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=service.redis.port).get("x")


@pytest.mark.parametrize("token", ["", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(service, token):
    with GenerationClient(service.address, token=token, timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt=PROMPTS[0], max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in err.value.details()


def test_cancelled_stream_stops_and_server_keeps_serving(client, reference):
    stream = client.generate(prompt=PROMPTS[0], max_new_tokens=200, ignore_eos=True)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError):
        list(stream)
    assert (tokens(collect(client.generate(prompt=PROMPTS[1], max_new_tokens=24, ignore_eos=True)))
            == want(reference, PROMPTS[1]))


def test_disaggregated_drafter_killed_and_verifier_killed(service, model_dirs, reference):
    """Two drafter replicas: identical output; a drafter replica killed mid-stream; the verifier killed
    mid-stream and the client resuming with its session id."""
    verifier = {"ray_actor_options": ACTOR, "max_ongoing_requests": 4, "max_queued_requests": 1}
    drafter = {"ray_actor_options": ACTOR, "autoscaling_config": {"min_replicas": 2, "max_replicas": 2}}
    service.deploy(config_tree(model_dirs, service.config.redis.url, "disaggregated", verifier=verifier,
                               drafter=drafter))
    with GenerationClient(service.address, token=TOKEN, timeout_s=120) as client:
        got, killed, session = [], None, None
        stream = client.generate(prompt=PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        for chunk in stream:
            got += chunk.token_ids
            session = session or chunk.session_id
            drafted = [r.drafter for r in chunk.rounds if r.index >= 4 and r.drafter]  # chunks carry several
            if killed is None and drafted:
                killed = drafted[-1]
                kill_process_listening_on(killed)
        assert got == want(reference, PROMPTS[0], 40) and killed
        assert_drafters_report_their_load(service.config.app_name)
        check_one_trace_across_processes(session, killed)

        received, session = [], None
        stream = client.generate(prompt=PROMPTS[3], max_new_tokens=40, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as lost:
            for chunk in stream:
                session = chunk.session_id
                received += chunk.token_ids
                if len(received) >= 10:
                    kill_verifier_replica()
        assert_lost_stream(lost.value, service.config.ingress_proxy)
        rest = resume_until_served(client, session, len(received))
        assert received + rest == want(reference, PROMPTS[3], 40)


def test_drafter_replicas_refuse_calls_without_the_token(service):
    """The launcher generated drafter_net.token; the replicas of the disaggregated deployment refuse
    whoever does not send it, and answer the verifier, who does."""
    from dflash.api.internal.v1 import drafter_pb2, drafter_pb2_grpc
    from dflash.service.drafter_client import describe
    from dflash.service.session_store import RedisSessionStore

    net = service.config.drafter_net
    assert len(net.token) >= 32
    store = RedisSessionStore(service.config.redis.url)

    def both_live():
        live = store.drafters()
        return live if len(live) == 2 else None

    # the previous test killed one replica: Ray's replacement advertises itself once it has started
    replicas = wait_until(both_live, 180, "both drafter replicas to advertise themselves", interval_s=0.5)
    for address in replicas:
        with grpc.insecure_channel(address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Describe(drafter_pb2.DescribeRequest(), timeout=30, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert describe(address, net=net).block_size > 1


def test_overload_is_resource_exhausted(service, client):
    """The disaggregated deployment admits 4 running + 1 queued verifier requests."""
    errors, lock = [], threading.Lock()

    def one():
        try:
            list(client.generate(prompt=PROMPTS[2], max_new_tokens=60, ignore_eos=True))
        except grpc.RpcError as exc:
            with lock:
                errors.append(exc.code())

    threads = [threading.Thread(target=one) for _ in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in errors


def test_redis_restart_keeps_sessions_and_outage_is_unavailable(service, client, reference):
    """Redis restarted mid-stream (AOF on): the session survives and the client gets all its tokens.
    Redis down: UNAVAILABLE with a clear message and health NOT_SERVING; back up: served again."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    redis_server = service.redis  # the launcher's; stop() is deliberate, so its supervisor stands by

    received, session, restarted = [], None, False
    try:
        for chunk in client.generate(prompt=PROMPTS[2], max_new_tokens=30, ignore_eos=True):
            session = chunk.session_id
            received += chunk.token_ids
            if len(received) >= 5 and not restarted:  # a chunk may carry several rounds
                redis_server.restart()
                restarted = True
        rest = []
    except grpc.RpcError as exc:  # a round's write fell into the restart: resume
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        rest = resume_until_served(client, session, len(received))
    assert received + rest == want(reference, PROMPTS[2], 30)

    redis_server.stop()
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt=PROMPTS[1], max_new_tokens=8))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.value.details()
        assert redis_server.password not in err.value.details()  # the URL in the message is redacted
        with grpc.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        redis_server.start()
    assert (tokens(collect(client.generate(prompt=PROMPTS[1], max_new_tokens=24, ignore_eos=True)))
            == want(reference, PROMPTS[1]))


def test_a_killed_redis_comes_back_and_health_with_it(service, client, reference, caplog):
    """SIGKILL the redis-server the launcher started: its supervisor restarts it (same directory, same
    port, AOF), logs it, and health is SERVING again with nobody acting; requests are served again."""
    import logging
    import os
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    redis_server = service.redis
    restarts, pid = redis_server.restarts, redis_server.process.pid
    with caplog.at_level(logging.WARNING, logger="dflash.service"):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                time.sleep(0.5)
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=60).status
                if redis_server.restarts > restarts and status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert time.monotonic() < deadline, "health did not come back by itself"
    assert redis_server.process.pid != pid
    assert any("restarted" in r.getMessage() for r in caplog.records)
    assert (tokens(collect(client.generate(prompt=PROMPTS[0], max_new_tokens=24, ignore_eos=True)))
            == want(reference, PROMPTS[0]))


def read_spans() -> list[dict]:
    """Every span the replicas wrote, tagged with the file (= service and process) it came from."""
    spans = []
    for path in Path(TRACE_DIR).glob("spans-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append({**json.loads(line), "file": path.name})
    return spans


def check_one_trace_across_processes(session: str, killed_drafter: str) -> None:
    """The request span (ingress) and its round spans (verifier) share one trace; each round links to
    the batched `dflash.step` it ran in (a trace of its own: a step serves many requests), whose
    `dflash.drafts` calls are the parents of the drafter replicas' spans; drafts ran in two drafter
    processes (the one killed mid-stream, then the survivor)."""
    def request_spans() -> list[dict]:  # the ingress ends its span after the last chunk is sent
        return [s for s in read_spans() if s["attributes"].get("gen_ai.response.id") == session]

    [request] = wait_until(request_spans, 30, "the request's span", interval_s=0.5)
    spans = read_spans()
    assert request["name"] == "text_completion tiny" and request["kind"] == "SpanKind.SERVER"
    assert request["attributes"]["gen_ai.request.model"] == "tiny"
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 40
    trace_id = request["context"]["trace_id"]
    in_trace = [s for s in spans if s["context"]["trace_id"] == trace_id]
    rounds = [s for s in in_trace if s["name"] == "dflash.round"]
    assert len(rounds) >= 5 and all(r["file"].startswith("spans-dflash-verifier-") for r in rounds)
    assert all(r["parent_id"] == request["context"]["span_id"] for r in rounds)
    assert all(len(r["links"]) == 1 for r in rounds)
    step_ids = {r["links"][0]["context"]["span_id"] for r in rounds}
    steps = [s for s in spans if s["name"] == "dflash.step" and s["context"]["span_id"] in step_ids]
    assert len(steps) == len(step_ids) and all(s["file"].startswith("spans-dflash-verifier-") for s in steps)
    calls = {s["context"]["span_id"] for s in spans if s["name"] == "dflash.drafts" and s["parent_id"] in step_ids}
    drafts = [s for s in spans if s["name"] == "dflash.draft" and s["parent_id"] in calls]
    assert drafts and all(d["file"].startswith("spans-dflash-drafter-") for d in drafts)
    replicas = {d["attributes"]["dflash.drafter.replica"] for d in drafts}
    assert killed_drafter in replicas and len({d["file"] for d in drafts}) == 2, replicas
    assert any(d["attributes"]["dflash.drafter.rebuilt"] for d in drafts
               if d["attributes"]["dflash.drafter.replica"] != killed_drafter)


def assert_drafters_report_their_load(app_name: str, timeout_s: float = 60) -> None:
    """Serve's controller holds the metrics drafter replicas return from record_autoscaling_stats
    (read through the controller's testing hook, ray_internals.controller_metrics: Serve has no public
    view of custom metrics)."""
    from dflash.service.autoscaling import HOT_SESSIONS, INFLIGHT_DRAFTS
    from ray_internals import controller_metrics

    # replicas push their metrics every 10 s
    wait_until(lambda: {INFLIGHT_DRAFTS, HOT_SESSIONS} <= set(controller_metrics(app_name, "drafter")), timeout_s,
               "the drafter's custom autoscaling metrics at the controller", interval_s=1.0)


def resume_until_served(client, session, received, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return tokens(collect(client.resume(session, received)))
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def kill_verifier_replica(wait_s: float = 30.0) -> None:
    """ray.kill the verifier's replica actor (Serve starts a new one).

    Waits for one to be listed: once, in a full-suite run on 2 busy cores, the named-actor list had no
    verifier mid-stream (the test passed alone); Serve replacing a replica that missed a health check
    would look like that, and the list omits a replica until it is up."""
    deadline = time.monotonic() + wait_s
    while True:
        names = ray.util.list_named_actors(all_namespaces=True)
        for actor in names:
            if "verifier" in actor["name"]:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"no verifier replica among {names}")
        time.sleep(0.5)


def kill_process_listening_on(address: str) -> None:
    """SIGKILL the drafter replica process serving `address` (a crash, not a clean stop)."""
    import os
    import signal

    import psutil

    host, port = address.rsplit(":", 1)
    port = int(port)
    for conn in psutil.net_connections(kind="tcp"):
        # The host too: a Ray worker may listen on the same port number on another interface.
        ip = conn.laddr.ip.removeprefix("::ffff:") if conn.laddr else ""  # gRPC listens on IPv4-mapped v6
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and ip == host and conn.pid:
            os.kill(conn.pid, signal.SIGKILL)
            return
    raise AssertionError(f"nothing listens on {address}")
