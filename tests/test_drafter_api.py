"""The internal Drafter API of a replica: only the verifier may call it, and what it cannot read it
refuses with INVALID_ARGUMENT.

Real drafter replicas (DrafterServer on the tiny models) over real gRPC on loopback, a real Redis
registry; mutual TLS with certificates made at test time. Also: rounds the target drafts alone after
the only replica died name no replica (RoundStats.drafter "").
"""

from __future__ import annotations

import dataclasses
import logging

import grpc
import pytest
import torch
from dflash.api.internal.v1 import drafter_pb2
from dflash.drafter.protocol import DraftSampling
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.config import ConfigError, DrafterNetConfig, ServiceConfig
from dflash.service.drafter_auth import server_credentials
from dflash.service.drafter_client import RemoteDrafter, describe
from dflash.service.drafter_server import DrafterServer
from dflash.service.messages import MAX_MESSAGE_CHARS, StreamError, VerifyRequest
from dflash.service.parts import build_draft_sessions, build_verifier_engine
from dflash.service.session_store import RedisSessionStore
from dflash.service.verifier import Verifier
from service_fixtures import model_dirs, redis_server, redis_url, wait_until  # noqa: F401
from test_tls import _write_pki

TOKEN = "drafter-s3cret"
SERVICE = "/dflash.internal.v1.Drafter/"
pytestmark = pytest.mark.timeout(300)


def config_for(model_dirs, redis_url, **net):  # noqa: F811
    target, drafter = model_dirs
    return ServiceConfig.from_dict({
        "mode": "disaggregated", "redis": {"url": redis_url}, "scheduler": {"verify_policy": "full"},
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32"},
        "drafter_net": {"retry_after_s": 0.2, "timeout_s": 5.0, "token": TOKEN, **net}})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _write_pki(tmp_path_factory.mktemp("pki"), "drafter")


@pytest.fixture
def replica(model_dirs, redis_url):  # noqa: F811
    """A replica that wants the token: (server, config, store)."""
    config = config_for(model_dirs, redis_url)
    store = RedisSessionStore(redis_url)
    server = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2, token=TOKEN).start()
    advertised(store, server.address)
    yield server, config, store
    server.stop()


def advertised(store, address, timeout_s=10.0):
    wait_until(lambda: address in store.drafters(), timeout_s, f"{address} to advertise itself")


def status_of(address, method, messages, token=TOKEN, credentials=None):
    """(status code, details) of a call with hand-made request bytes."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with channel:
        try:
            if method == "DraftBatch":
                channel.stream_unary(SERVICE + method)(iter(messages), timeout=30, metadata=metadata)
            else:
                channel.unary_unary(SERVICE + method)(messages[0], timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def chunk(width=None, **fields) -> bytes:
    """One DraftRequestChunk's bytes: a valid head for `width` features unless fields say otherwise."""
    rows = fields.pop("rows", 3)
    context = fields.pop("context", None)
    if context is None and width is not None:
        context = drafter_pb2.Tensor(dtype="float32", shape=[rows, width], data=bytes(4 * rows * width))
    head = {"session_id": "s.1", "context_start": 0, "last_token": 5, "block_size": 8, **fields}
    return drafter_pb2.DraftRequestChunk(context=context, **head).SerializeToString()


# --- who may call ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["", "wrong"])
def test_every_method_refuses_a_caller_without_the_token(replica, token):
    server, _, _ = replica
    width = server.sessions.drafter.model.fc.in_features
    calls = {"Describe": [b""], "Release": [drafter_pb2.ReleaseRequest(session_id="s.1").SerializeToString()],
             "DraftBatch": [chunk(width)]}
    for method, messages in calls.items():
        code, details = status_of(server.address, method, messages, token=token)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "drafter_net.token" in details, method
    assert server.sessions.num_sessions == 0  # nothing was drafted for them


def test_the_verifier_with_the_token_drafts_as_the_local_drafter(replica):
    server, config, store = replica
    assert describe(server.address, net=config.drafter_net).block_size == 8
    local = server.sessions.drafter
    features = torch.randn(12, local.model.fc.in_features)
    remote = RemoteDrafter(store, 8, local.mask_token_id, local.target_layer_ids, config.drafter_net)
    got = remote.draft("x", features, 0, 5, 8, DraftSampling())
    server.sessions.release("x")
    assert torch.equal(got, local.draft("x", features, 0, 5, 8, DraftSampling())) and len(got) == 7


def test_a_verifier_with_another_token_drafts_nothing_and_says_why(replica, caplog):
    server, config, store = replica
    net = dataclasses.replace(config.drafter_net, token="not-the-token")
    local = server.sessions.drafter
    remote = RemoteDrafter(store, 8, local.mask_token_id, local.target_layer_ids, net)
    features = torch.randn(5, local.model.fc.in_features)
    with caplog.at_level(logging.WARNING, logger="dflash.service"):
        assert remote.draft("y", features, 0, 5, 8).numel() == 0  # a target-only round, still exact
        remote.draft("z", features, 0, 5, 8)
    refused = [r for r in caplog.records if "refused the verifier" in r.getMessage()]
    assert len(refused) == 1 and "UNAUTHENTICATED" in refused[0].getMessage() and "not-the-token" not in caplog.text


def test_mutual_tls_between_verifier_and_replica(model_dirs, redis_url, pki, tmp_path):  # noqa: F811
    net = {"tls_cert_file": pki["server"], "tls_key_file": pki["server_key"], "tls_ca_file": pki["ca"]}
    config = config_for(model_dirs, redis_url, **net)
    store = RedisSessionStore(redis_url)
    server = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2, token=TOKEN,
                           credentials=server_credentials(config.drafter_net)).start()
    try:
        assert describe(server.address, net=config.drafter_net).block_size == 8
        named = dataclasses.replace(config.drafter_net, tls_server_name="dflash.test")
        assert describe(server.address, net=named).block_size == 8
        # plaintext, or TLS without a client certificate the CA signed: no connection at all
        assert status_of(server.address, "Describe", [b""])[0] == grpc.StatusCode.UNAVAILABLE
        anonymous = grpc.ssl_channel_credentials(open(pki["ca"], "rb").read())
        assert status_of(server.address, "Describe", [b""], credentials=anonymous)[0] == grpc.StatusCode.UNAVAILABLE
        other = _write_pki(tmp_path / "other", "other")  # a client certificate another CA signed
        stranger = grpc.ssl_channel_credentials(open(pki["ca"], "rb").read(), open(other["client_key"], "rb").read(),
                                                open(other["client"], "rb").read())
        assert status_of(server.address, "Describe", [b""], credentials=stranger)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


@pytest.mark.parametrize(("net", "key"), [
    ({"tls_cert_file": "c.pem"}, "drafter_net.tls_key_file"),
    ({"tls_cert_file": "c.pem", "tls_key_file": "k.pem"}, "drafter_net.tls_ca_file"),
    ({"tls_server_name": "x"}, "drafter_net.tls_server_name"),
])
def test_drafter_tls_config_errors_name_the_key(net, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ServiceConfig.from_dict({"drafter_net": net})
    assert DrafterNetConfig(token="t").token == "t"


# --- what a replica cannot read ----------------------------------------------------------------------

def malformed_streams(width):
    big = "x" * 100_000
    return {
        "random bytes": ("DraftBatch", [b"\xff\xfe\xfd\xfc garbage"]),
        "truncated varint": ("DraftBatch", [b"\x10\xff"]),
        "headerless first chunk": ("DraftBatch", [drafter_pb2.DraftRequestChunk(
            context=drafter_pb2.Tensor(data=b"1234")).SerializeToString()]),
        "empty stream": ("DraftBatch", []),
        "one-dimensional context": ("DraftBatch", [chunk(context=drafter_pb2.Tensor(
            dtype="float32", shape=[width], data=bytes(4 * width)))]),
        "context of the wrong width": ("DraftBatch", [chunk(width + 1)]),
        "integer context": ("DraftBatch", [chunk(context=drafter_pb2.Tensor(
            dtype="int64", shape=[2, width], data=bytes(16 * width)))]),
        "bytes that do not fit the shape": ("DraftBatch", [chunk(context=drafter_pb2.Tensor(
            dtype="float32", shape=[2, width], data=b"12"))]),
        "a shape beyond any tensor": ("DraftBatch", [chunk(context=drafter_pb2.Tensor(
            dtype="float32", shape=[0, (1 << 64) - 1], data=b""))]),
        "a 100 KB dtype": ("DraftBatch", [chunk(context=drafter_pb2.Tensor(dtype=big, shape=[1], data=b""))]),
        "a 100 KB session id": ("DraftBatch", [chunk(width, session_id=big)]),
        "last token outside the vocabulary": ("DraftBatch", [chunk(width, last_token=1 << 20)]),
        "block size 1": ("DraftBatch", [chunk(width, block_size=1)]),
        "block size beyond the drafter's": ("DraftBatch", [chunk(width, block_size=64)]),
        "a position beyond any context": ("DraftBatch", [chunk(width, context_start=(1 << 64) - 1, restart=True)]),
        "a temperature it cannot divide by": ("DraftBatch", [chunk(width, temperature=1e-40)]),
        "a session twice in one call": ("DraftBatch", [chunk(width), chunk(width)]),
        "Release of random bytes": ("Release", [b"\xff\xfe"]),
        "Release of a 100 KB session id": ("Release", [drafter_pb2.ReleaseRequest(session_id=big).SerializeToString()]),
        "Describe of random bytes": ("Describe", [b"\xff\xfe"]),
    }


def test_malformed_calls_are_invalid_argument_with_a_short_message(replica):
    server, _, _ = replica
    width = server.sessions.drafter.model.fc.in_features
    for name, (method, messages) in malformed_streams(width).items():
        code, details = status_of(server.address, method, messages)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details[:200])
        assert details and len(details) <= MAX_MESSAGE_CHARS, (name, len(details))
    assert status_of(server.address, "DraftBatch", [chunk(width)]) == (grpc.StatusCode.OK, "")  # still serving


# --- RoundStats.drafter after the only replica died ----------------------------------------------------

def test_rounds_after_the_only_replica_died_name_no_replica(model_dirs, redis_url):  # noqa: F811
    """The proto says RoundStats.drafter is "" when no replica drafted: rounds the target ran alone
    after the replica died must not name the dead replica."""
    config = config_for(model_dirs, redis_url)
    store = RedisSessionStore(redis_url)
    server = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2, token=TOKEN).start()
    advertised(store, server.address)
    verifier = Verifier(build_verifier_engine(config, store, None), store, "tiny")
    reference = build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")
    prompt = "def f(x):\n    return"
    drafters, got = [], []
    try:
        for c in verifier.stream(VerifyRequest("only-replica", {"max_new_tokens": 40, "ignore_eos": True},
                                               prompt_text=prompt)):
            assert not isinstance(c, StreamError), c
            got += c.token_ids
            drafters += [r.drafter for r in c.rounds]
            if c.round.index == 3:
                server.stop()
    finally:
        server.stop()
    want = reference.run(reference.encode(prompt), SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids
    assert got == want
    assert server.address in drafters[:4]  # before: the replica drafted
    assert drafters[5:] and set(drafters[5:]) == {""}  # after: target-only rounds name nobody
