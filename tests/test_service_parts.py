"""Service parts without Ray: generated code, codec, config, ingress checks, the session store on real Redis."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dflash.api.v1 import generate_pb2
from dflash.errors import InvalidRequestError
from dflash.journal import CommittedRound
from dflash.service import codec
from dflash.service.config import ConfigError, ServiceConfig, load_config
from dflash.service.ingress import Ingress, Rejected
from dflash.service.session_store import (
    FINISHED,
    RUNNING,
    MemorySessionStore,
    RedisSessionStore,
    SessionNotFoundError,
    SessionRecord,
    StoreUnavailableError,
)
from service_fixtures import redis_server, redis_url  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    """scripts/gen_protos.py (not part of the installed package) regenerates into tmp_path; same files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    gen_protos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_protos)
    gen_protos.generate(tmp_path)
    for fresh in sorted(tmp_path.rglob("*.py*")):
        checked_in = REPO / "services" / fresh.relative_to(tmp_path)
        assert checked_in.exists(), f"{checked_in} missing: run scripts/gen_protos.sh"
        assert checked_in.read_text() == fresh.read_text(), f"{checked_in} is stale: run scripts/gen_protos.sh"


def test_ingress_and_app_never_import_torch():
    code = "import sys, dflash.service.app, dflash.service.ingress; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_round_trips_in_chunks(dtype):
    context = torch.randn(37, 24).to(dtype)
    chunks = list(codec.draft_request_chunks("s", context, 5, 9, 8, chunk_bytes=100))
    assert len(chunks) > 1 and chunks[0].context.shape == [37, 24]
    [back] = codec.join_draft_batch(iter(chunks))
    assert back.session_id == "s" and back.context_start == 5 and back.last_token == 9 and not back.restart
    assert back.context.dtype == dtype and torch.equal(back.context, context)
    [request] = codec.join_draft_batch(iter(list(codec.draft_request_chunks("s", context, 5, 9, 8, 100, restart=True))))
    assert request.restart and request.context_start == 5


def test_codec_rejects_short_data():
    with pytest.raises(codec.CodecError, match="needs 16 bytes"):
        codec.from_parts("float32", (2, 2), b"\0" * 12)


def test_config_layers_yaml_env_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: disaggregated\nverifier:\n  max_ongoing_requests: 3\n  ray_actor_options: {num_gpus: 1}\n")
    config = load_config(path, env={"DFLASH_REDIS__TTL_S": "60", "DFLASH_GRPC_PORT": "9100"},
                         overrides={"drafter.num_replicas": 2})
    assert config.mode == "disaggregated" and config.redis.ttl_s == 60 and config.grpc_port == 9100
    assert config.verifier.serve_options()["ray_actor_options"] == {"num_gpus": 1}
    assert config.drafter.serve_options()["num_replicas"] == 2
    assert ServiceConfig.from_dict(config.to_dict()) == config  # what the chart renders loads back


@pytest.mark.parametrize("tree, field", [
    ({"redis": {"urll": "x"}}, "redis.urll"), ({"mode": "split"}, "mode"), ({"grpc_port": "nine"}, "grpc_port"),
    ({"drafter_net": {"workers": 0}}, "drafter_net.workers"),
])
def test_config_errors_name_the_key(tree, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ServiceConfig.from_dict(tree)


@pytest.mark.parametrize("fields, named", [
    ({}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
    ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 10**6}, "max_new_tokens"),
    ({"prompt": "x", "draft_confidence": 1.0}, "draft_confidence"),
    ({"prompt": "x" * 5000}, "request"),
    ({"session_id": "abc", "temperature": 0.5}, "temperature"),
    ({"prompt": "x", "tokens_received": 3}, "tokens_received"),
])
def test_ingress_rejects_bad_requests_naming_the_field(fields, named):
    ingress = Ingress(ServiceConfig.from_dict({"limits": {"max_request_bytes": 4096}}))
    with pytest.raises(Rejected) as err:
        ingress.admit(generate_pb2.GenerateRequest(**fields), {})
    assert err.value.code == "INVALID_ARGUMENT" and err.value.message.startswith(named)


def test_ingress_rejects_unknown_fields_and_checks_the_token():
    ingress = Ingress(ServiceConfig(auth_token="s3cret"))
    good = generate_pb2.GenerateRequest(prompt="x")
    with pytest.raises(Rejected) as err:
        ingress.admit(good, {"authorization": "Bearer wrong"})
    assert err.value.code == "UNAUTHENTICATED"
    assert ingress.admit(good, {"authorization": "Bearer s3cret"}).params == {"ignore_eos": False}
    unknown = generate_pb2.GenerateRequest.FromString(good.SerializeToString() + b"\xa8\x06\x01")  # field 101
    with pytest.raises(Rejected, match="field number 101"):
        ingress.admit(unknown, {"authorization": "Bearer s3cret"})


@pytest.fixture(params=["redis", "memory"])
def store(request, redis_url):
    return RedisSessionStore(redis_url, ttl_s=30) if request.param == "redis" else MemorySessionStore()


def test_session_store_round_trip(store):
    store.create(SessionRecord("s1", [1, 2, 3], {"max_new_tokens": 9}, seed=7, model="m"))
    assert store.commit_rounds([CommittedRound("s1", 1, [4, 5], 1)]) == set()
    store.commit_rounds([CommittedRound("s1", 1, [6], 2)])
    record = store.get("s1")
    assert record.prompt_ids == [1, 2, 3] and record.model == "m" and record.owner == 1
    assert record.output_ids == [4, 5, 6] and record.seed == 7 and record.num_rounds == 2
    assert record.sampling_params().max_new_tokens == 9
    assert store.finish("s1", 1, FINISHED, {"tau": 1.5})
    record = store.get("s1")
    assert record.status == FINISHED and record.final == {"tau": 1.5}
    assert store.get("nope") is None


def test_take_over_truncates_and_fences_the_previous_stream(store):
    store.create(SessionRecord("s1", [1], {}, seed=7))
    store.create(SessionRecord("s2", [1], {}, seed=8))
    store.commit_rounds([CommittedRound("s1", 1, [4, 5, 6], 3), CommittedRound("s2", 1, [9], 1)])
    taken = store.take_over("s1", 1)
    assert taken.owner == 2 and taken.output_ids == [4] and taken.status == RUNNING and taken.seed == 7
    # the old stream (owner 1) can no longer commit or finish; the other session in its step still can
    assert store.commit_rounds([CommittedRound("s2", 1, [10], 2), CommittedRound("s1", 1, [7], 4)]) == {1}
    assert not store.finish("s1", 1, "cancelled")
    assert store.get("s1").output_ids == [4] and store.get("s1").status == RUNNING
    assert store.get("s2").output_ids == [9, 10]
    store.commit_rounds([CommittedRound("s1", 2, [8], 2)])
    assert store.finish("s1", 2, FINISHED, {"tau": 2.0})
    done = store.take_over("s1", 2)  # finished and the client has it all: nothing to take over
    assert done.status == FINISHED and done.owner == 2 and done.output_ids == [4, 8]
    with pytest.raises(InvalidRequestError, match="tokens_received: 3 exceeds the 2 tokens"):
        store.take_over("s1", 3)
    with pytest.raises(SessionNotFoundError, match="session_id"):
        store.take_over("x" * 10_000, 0)
    try:
        store.take_over("y" * 10_000, 0)
    except SessionNotFoundError as exc:
        assert len(str(exc)) < 200  # never echoes unbounded input
    assert store.commit_rounds([CommittedRound("gone", 1, [1], 1)]) == {0}


def test_racing_take_overs_leave_one_owner(store):
    """Two resumes of one session at once: each gets its own token, only the later one can commit."""
    import threading

    store.create(SessionRecord("r", [1], {}, seed=1))
    store.commit_rounds([CommittedRound("r", 1, [2, 3, 4], 3)])
    owners, barrier = [], threading.Barrier(2)

    def resume(received):
        barrier.wait()
        owners.append((store.take_over("r", received).owner, received))

    threads = [threading.Thread(target=resume, args=(2,)) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(o for o, _ in owners) == [2, 3]
    (loser, _), (winner, _) = sorted(owners)
    # one step can hold the old stream and the new one of a session: only the owner's round is written
    assert store.commit_rounds([CommittedRound("r", loser, [9], 9), CommittedRound("r", winner, [5], 4)]) == {0}
    assert store.get("r").output_ids[-1] == 5 and store.get("r").owner == winner


def test_dead_drafters_leave_the_registry(store):
    store.advertise_drafter("h:1", ttl_s=30)
    store.advertise_drafter("h:2", ttl_s=0.05)
    time.sleep(0.1)
    assert store.drafters() == ["h:1"]
    if isinstance(store, RedisSessionStore):
        assert store.redis.zcard(f"{store.prefix}:drafters") == 1  # removed, not only skipped


def test_sessions_survive_a_redis_restart(redis_server, redis_url):
    store = RedisSessionStore(redis_url)
    store.create(SessionRecord("live", [1], {}, seed=3))
    store.commit_rounds([CommittedRound("live", 1, [2, 3], 1)])
    redis_server.restart()  # AOF on: the write is on disk before SIGTERM completes
    assert store.get("live").output_ids == [2, 3]


def test_unreachable_redis_is_a_clear_error():
    store = RedisSessionStore("redis://:hunter2@127.0.0.1:1/0", socket_timeout_s=0.5)
    with pytest.raises(StoreUnavailableError, match="unreachable") as err:
        store.get("x")
    assert "hunter2" not in str(err.value) and "redis://:***@127.0.0.1:1/0" in str(err.value)  # logs see it too


def test_prometheus_metrics_record_rounds_requests_and_errors():
    from dflash.service.metrics import ServiceMetrics

    metrics = ServiceMetrics("prometheus")
    metrics.record_round()
    metrics.record_fallback()
    metrics.record_request("finished", tau=3.5, tokens_per_s=120.0)
    metrics.record_error("INVALID_ARGUMENT")
    value = metrics.registry.get_sample_value
    assert value("dflash_rounds_total") == 1 and value("dflash_drafter_fallbacks_total") == 1
    assert value("dflash_requests_total", {"status": "finished"}) == 1
    assert value("dflash_errors_total", {"code": "INVALID_ARGUMENT"}) == 1
    assert value("dflash_tau_sum") == 3.5 and value("dflash_decode_tokens_per_second_count") == 1


def test_replica_config_layers_its_environment_over_the_args():
    """The chart passes secrets and the pod address as DFLASH_* variables; each replica reads them."""
    from dflash.service.config import ConfigError, ServiceConfig

    args = {"mode": "disaggregated", "redis": {"url": "redis://args:6379/0"}}
    env = {"DFLASH_REDIS__URL": "redis://secret:6379/1", "DFLASH_AUTH_TOKEN": "0123456789",
           "DFLASH_DRAFTER_NET__HOST": "10.1.2.3", "UNRELATED": "x"}
    cfg = ServiceConfig.for_replica(args, env=env)
    assert cfg.redis.url == "redis://secret:6379/1"
    assert cfg.auth_token == "0123456789"  # digits stay a string
    assert cfg.drafter_net.host == "10.1.2.3"
    assert ServiceConfig.for_replica(args, env={}).redis.url == "redis://args:6379/0"
    import pytest

    with pytest.raises(ConfigError, match="drafter_net.port"):
        ServiceConfig.for_replica(args, env={"DFLASH_DRAFTER_NET__PORT": "not-a-number"})
