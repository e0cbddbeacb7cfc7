"""TLS on the public port: the TLS front over real gRPC on loopback, in front of a real upstream.

The upstream is what IngressDeployment serves, minus Ray: the real Ingress (auth, request checks,
errors) over a real Verifier on the tiny models, on a plain grpc.aio server with the standard health
and reflection services. (Ray Serve's proxy costs tens of seconds to start here; the launcher's
wiring of the front in front of it is checked by the slow test at the end.) Certificates are made
at test time with `cryptography`: a CA, a server certificate it signs, a client certificate.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from dflash.api.v1 import generate_pb2, generate_pb2_grpc
from dflash.cli import main as dflash_main
from dflash.service.client import GenerationClient
from dflash.service.config import ConfigError, ServiceConfig, TlsConfig, load_config
from dflash.service.ingress import Ingress
from dflash.service.parts import build_verifier_engine
from dflash.service.redis_process import free_port
from dflash.service.session_store import MemorySessionStore
from dflash.service.tls_front import FrontThread, TlsFront
from dflash.service.verifier import Verifier
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from service_fixtures import IngressServicer, loop, model_dirs  # noqa: F401

TOKEN = "s3cret-token"
PROMPT = "def f(x):\n    return"
pytestmark = pytest.mark.timeout(300)


# --- certificates ------------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _certificate(cn, key, issuer_cn, issuer_key, ca=False, sans=()):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(issuer_cn))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pki(root, name: str) -> dict:
    """A CA, a server certificate for localhost / 127.0.0.1 / dflash.test, a client certificate: PEM files."""
    root.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate(f"{name} CA", ca_key, f"{name} CA", ca_key, ca=True)
    sans = (x509.DNSName("localhost"), x509.DNSName("dflash.test"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    files = {"ca": ca, "server": _certificate("dflash server", server_key, f"{name} CA", ca_key, sans=sans),
             "client": _certificate("dflash client", client_key, f"{name} CA", ca_key)}
    paths = {}
    for what, cert in files.items():
        paths[what] = root / f"{what}.crt"
        paths[what].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for what, key in (("server", server_key), ("client", client_key)):
        paths[f"{what}_key"] = root / f"{what}.key"
        paths[f"{what}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _write_pki(tmp_path_factory.mktemp("pki"), "test")


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# --- the upstream: the real Ingress over a real Verifier on a grpc.aio server ---------------------------

class Upstream(IngressServicer):
    """Generate as IngressDeployment.Generate serves it, with a gate the tests close to hold the engine
    after its first chunk, and a record of what arrived (metadata, deadline, cancellation)."""

    def __init__(self, ingress: Ingress, verifier: Verifier):
        super().__init__(ingress, verifier)
        self.gate = threading.Event()
        self.gate.set()
        self.seen: list[tuple[dict, float | None]] = []
        self.cancelled: list[threading.Event] = []

    def arrived(self, metadata, context):
        self.seen.append((metadata, context.time_remaining()))

    def _open_stream(self, verify, carrier):
        ended = threading.Event()  # set when the upstream stream ends (finished or cancelled)
        self.cancelled.append(ended)
        return self._gated(self.verifier.stream_async(verify, carrier), ended)

    async def _gated(self, chunks, ended):
        try:
            async for chunk in chunks:
                yield chunk
                while not self.gate.is_set():
                    await asyncio.sleep(0.05)
        finally:
            await chunks.aclose()
            ended.set()


def on(loop, coroutine, timeout_s: float = 30):
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout_s)


@pytest.fixture(scope="module")
def upstream(model_dirs, loop):  # noqa: F811
    """(servicer, "127.0.0.1:port") of the plaintext upstream."""
    target, drafter = model_dirs
    config = ServiceConfig.from_dict({
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "redis": {"url": "memory://"}, "auth_token": TOKEN, "metrics": "none"})
    store = MemorySessionStore()
    servicer = Upstream(Ingress(config), Verifier(build_verifier_engine(config, store, None), store, "tiny"))

    async def start():
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(("dflash.v1.Generation", "grpc.health.v1.Health",
                                             reflection.SERVICE_NAME), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = on(loop, start())
    yield servicer, f"127.0.0.1:{port}"
    on(loop, server.stop(0))


@pytest.fixture(scope="module")
def front(pki, upstream):
    """The TLS front before the upstream: "127.0.0.1:port"."""
    running = FrontThread(TlsFront(TlsConfig(pki["server"], pki["server_key"]), "127.0.0.1:0", upstream[1])).start()
    yield f"127.0.0.1:{running.port}"
    running.stop()


def tls_client(address, pki, token=TOKEN, timeout_s=120, **kw) -> GenerationClient:
    return GenerationClient(address, token, read(pki["ca"]), timeout_s, **kw)


def request(**fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(**{"prompt": PROMPT, "max_new_tokens": 24, "ignore_eos": True, **fields})


def essence(chunks) -> tuple:
    """What must match between two streams: tokens, text and the finish. Not the chunk boundaries (a server
    coalesces the rounds a slower reader has not taken yet), nor the rounds (the adaptive policy drafts
    by measured time)."""
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
            chunks[-1].HasField("final") and chunks[-1].final.finish_reason)


def failure(call) -> tuple:
    with pytest.raises(grpc.RpcError) as err:
        list(call()) if callable(call) else list(call)
    return err.value.code(), err.value.details()


# --- Generate through TLS ----------------------------------------------------------------------------

def test_tls_client_streams_what_a_direct_client_streams(upstream, front, pki):
    with tls_client(front, pki) as secure, GenerationClient(upstream[1], TOKEN, timeout_s=120) as direct:
        through_tls = list(secure.generate(request()))
        direct_chunks = list(direct.generate(request()))
    assert essence(through_tls) == essence(direct_chunks)
    assert through_tls[-1].final.usage.completion_tokens == 24 and len(through_tls) > 2


def test_chunks_are_relayed_as_they_arrive(upstream, front, pki):
    servicer = upstream[0]
    servicer.gate.clear()  # the engine holds after its first chunk
    try:
        with tls_client(front, pki) as client:
            stream = client.generate(request())
            first = next(stream)
            assert not servicer.gate.is_set() and first.session_id  # received while the upstream is held
            servicer.gate.set()
            rest = list(stream)
    finally:
        servicer.gate.set()
    assert sum(len(c.token_ids) for c in [first, *rest]) == 24 and rest[-1].HasField("final")


def test_a_client_that_cancels_cancels_the_upstream_call(upstream, front, pki):
    servicer = upstream[0]
    servicer.gate.clear()
    try:
        with tls_client(front, pki) as client:
            stream = client.generate(request(max_new_tokens=200))
            next(stream)
            stream.cancel()
            assert servicer.cancelled[-1].wait(10), "the upstream stream was not cancelled"
    finally:
        servicer.gate.set()


@pytest.mark.parametrize(("token", "message", "code"), [
    (TOKEN, request(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, request(max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, generate_pb2.GenerateRequest(session_id="no-such-session"), grpc.StatusCode.NOT_FOUND),
    ("wrong-token", request(), grpc.StatusCode.UNAUTHENTICATED),
    ("", request(), grpc.StatusCode.UNAUTHENTICATED),
], ids=["empty-prompt", "max-new-tokens", "unknown-session", "wrong-token", "no-token"])
def test_errors_arrive_with_the_upstreams_code_and_details(upstream, front, pki, token, message, code):
    with tls_client(front, pki, token) as secure, GenerationClient(upstream[1], token, timeout_s=60) as direct:
        through_tls = failure(lambda: secure.generate(message))
        assert through_tls == failure(lambda: direct.generate(message))
    assert through_tls[0] == code and through_tls[1]


def test_metadata_and_deadline_reach_the_upstream(upstream, front, pki):
    with tls_client(front, pki) as client:
        stub = generate_pb2_grpc.GenerationStub(client.channel)
        list(stub.Generate(request(max_new_tokens=4), timeout=50,
                           metadata=[("authorization", f"Bearer {TOKEN}"), ("x-request-id", "req-42")]))
    metadata, remaining = upstream[0].seen[-1]
    assert metadata["authorization"] == f"Bearer {TOKEN}" and metadata["x-request-id"] == "req-42"
    assert remaining is not None and 0 < remaining <= 51  # grpc-timeout is rounded up on each hop


def test_health_and_reflection_pass_through(front, pki):
    with tls_client(front, pki) as client:
        health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(client.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"dflash.v1.Generation", "grpc.health.v1.Health"} <= names


# --- what TLS refuses --------------------------------------------------------------------------------

def test_a_plaintext_client_is_refused(front):
    with GenerationClient(front, TOKEN, timeout_s=10) as client:
        assert failure(lambda: client.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE


def test_a_server_the_client_does_not_trust_is_refused(front, tmp_path):
    other = _write_pki(tmp_path / "other", "other")
    with GenerationClient(front, TOKEN, read(other["ca"]), timeout_s=10) as client:
        assert failure(lambda: client.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE


def test_server_name_override(front, pki):
    with tls_client(front, pki, server_name="dflash.test") as client:
        assert list(client.generate(request(max_new_tokens=2)))[-1].HasField("final")
    with tls_client(front, pki, server_name="elsewhere.test") as client:
        assert failure(lambda: client.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate(upstream, pki):
    tls = TlsConfig(pki["server"], pki["server_key"], client_ca_file=pki["ca"])
    running = FrontThread(TlsFront(tls, "127.0.0.1:0", upstream[1])).start()
    address = f"127.0.0.1:{running.port}"
    try:
        with tls_client(address, pki) as anonymous:
            assert failure(lambda: anonymous.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE
        with tls_client(address, pki, client_certificate=(read(pki["client_key"]), read(pki["client"]))) as client:
            assert list(client.generate(request(max_new_tokens=2)))[-1].HasField("final")
    finally:
        running.stop()


def test_renewed_certificate_files_are_used_for_new_connections(upstream, pki, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        (live / name).write_bytes(read(pki[name.replace(".crt", "").replace(".key", "_key")]))
    running = FrontThread(TlsFront(TlsConfig(str(live / "server.crt"), str(live / "server.key")),
                                   "127.0.0.1:0", upstream[1])).start()
    address = f"127.0.0.1:{running.port}"
    try:
        renewed = _write_pki(tmp_path / "renewed", "renewed")
        for name, source in (("server.crt", renewed["server"]), ("server.key", renewed["server_key"])):
            (live / f"{name}.new").write_bytes(read(source))
            os.replace(live / f"{name}.new", live / name)  # as a Secret volume swaps files: a new inode
        with GenerationClient(address, TOKEN, read(renewed["ca"]), timeout_s=60) as client:
            assert list(client.generate(request(max_new_tokens=2)))[-1].HasField("final")
        with tls_client(address, pki) as old_trust:
            assert failure(lambda: old_trust.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


# --- bad certificate files ---------------------------------------------------------------------------

def test_missing_or_unreadable_files_are_named(pki, tmp_path):
    with pytest.raises(ConfigError, match=r"tls\.cert_file: cannot read .*nope\.crt: No such file"):
        TlsFront(TlsConfig(str(tmp_path / "nope.crt"), pki["server_key"]), "127.0.0.1:0", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"tls\.key_file: cannot read .*nope\.key"):
        TlsFront(TlsConfig(pki["server"], str(tmp_path / "nope.key")), "127.0.0.1:0", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"tls\.client_ca_file: cannot read .*ca\.pem"):
        TlsFront(TlsConfig(pki["server"], pki["server_key"], str(tmp_path / "ca.pem")), "127.0.0.1:0", "127.0.0.1:1")


def test_files_that_are_not_pem_are_named(pki, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"tls\.cert_file: .*garbage\.pem holds no PEM CERTIFICATE"):
        TlsFront(TlsConfig(str(garbage), pki["server_key"]), "127.0.0.1:0", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"tls\.key_file: .*server\.crt holds no PEM PRIVATE KEY"):
        TlsFront(TlsConfig(pki["server"], pki["server"]), "127.0.0.1:0", "127.0.0.1:1")


def test_a_port_in_use_is_named(pki, front):
    with pytest.raises(ConfigError, match=f"tls: cannot listen on {front}"):
        FrontThread(TlsFront(TlsConfig(pki["server"], pki["server_key"]), front, "127.0.0.1:1")).start()


# --- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("tree", "message"), [
    ({"tls": {"cert_file": "c.pem"}}, "tls.key_file: must be set with tls.cert_file"),
    ({"tls": {"key_file": "k.pem"}}, "tls.cert_file: must be set with tls.key_file"),
    ({"tls": {"client_ca_file": "ca.pem"}}, "tls.cert_file: mutual TLS"),
    ({"tls": {"cert_file": "c", "key_file": "k", "upstream_port": 70000}},
     "tls.upstream_port: Input should be less than or equal to 65535"),
    ({"grpc_port": 9443, "tls": {"cert_file": "c", "key_file": "k", "upstream_port": 9443}},
     "tls.upstream_port: must differ"),
    ({"tls": {"cert": "c.pem"}}, "tls.cert: unknown configuration key"),
    ({"tls": {"upstream_port": "high"}}, "tls.upstream_port: Input should be a valid integer"),
])
def test_tls_config_errors_name_the_key(tree, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        ServiceConfig.from_dict(tree)


def test_tls_config_from_the_environment():
    config = load_config(env={"DFLASH_TLS__CERT_FILE": "/etc/tls/tls.crt", "DFLASH_TLS__KEY_FILE": "/etc/tls/tls.key",
                              "DFLASH_TLS__UPSTREAM_PORT": "9001"})
    assert config.tls == TlsConfig("/etc/tls/tls.crt", "/etc/tls/tls.key", "", 9001) and config.tls.enabled
    assert not ServiceConfig().tls.enabled


# --- the commands ------------------------------------------------------------------------------------

def test_dflash_client_over_tls(front, pki, capsys):
    code = dflash_main(["client", "--server", front, "--token", TOKEN, "--tls-ca", pki["ca"],
                        "--tls-server-name", "dflash.test", "--max-new-tokens", "6", PROMPT])
    out, err = capsys.readouterr()
    assert code == 0 and "6 tokens, finish=length" in err and out.strip()
    assert dflash_main(["client", "--server", front, "--tls-ca", str(pki["ca"]) + ".missing", PROMPT]) == 2
    assert "--tls-ca: cannot read" in capsys.readouterr().err


def test_dflash_tls_front_serves_until_sigterm(upstream, pki):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "tls-front", "--listen", f"127.0.0.1:{port}", "--upstream", upstream[1],
         "--cert", pki["server"], "--key", pki["server_key"]], stderr=subprocess.PIPE, text=True)
    try:
        with tls_client(f"127.0.0.1:{port}", pki) as client:
            grpc.channel_ready_future(client.channel).result(timeout=60)
            assert list(client.generate(request(max_new_tokens=2)))[-1].HasField("final")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert f"TLS on 127.0.0.1:{port}" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_dflash_tls_front_names_a_missing_file(capsys, tmp_path):
    assert dflash_main(["tls-front", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]) == 2
    assert "tls.cert_file: cannot read" in capsys.readouterr().err


# --- dflash serve with TLS: Ray Serve's proxy behind the front ----------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_service_serves_tls_on_the_public_port(model_dirs, pki):  # noqa: F811
    pytest.importorskip("ray")
    from dflash.service.launcher import start_local

    target, drafter = model_dirs
    public = free_port()
    config = ServiceConfig.from_dict({
        "grpc_port": public, "torch_threads": 1, "auth_token": TOKEN, "redis": {"url": "memory://"},
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}}, "verifier": {"ray_actor_options": {"num_cpus": 0.1}},
        "tls": {"cert_file": pki["server"], "key_file": pki["server_key"]}})
    started = time.monotonic()
    service = start_local(config, num_cpus=2)
    try:
        assert service.address == f"127.0.0.1:{public}" and service.front.port == public
        with tls_client(service.address, pki) as client:
            chunks = list(client.generate(request(max_new_tokens=8)))
            health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert chunks[-1].final.usage.completion_tokens == 8 and health.status == health_pb2.HealthCheckResponse.SERVING
        with GenerationClient(service.address, TOKEN, timeout_s=10) as plaintext:
            assert failure(lambda: plaintext.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop()
    with tls_client(f"127.0.0.1:{public}", pki, timeout_s=5) as client:  # the front stopped with the service
        assert failure(lambda: client.generate(request()))[0] == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 900
