"""Drafter autoscaling: the policy on real Serve AutoscalingContexts, its wiring into the drafter's
options and config checks, and the load a real drafter server reports during a Draft call."""

import threading
import time

import grpc
import pytest
import torch
from dflash.api.internal.v1 import drafter_pb2_grpc
from dflash.service import codec
from dflash.service.autoscaling import HOT_SESSIONS, INFLIGHT_DRAFTS, POLICY_FUNCTION, DraftLoadPolicy
from dflash.service.config import ConfigError, ServiceConfig
from dflash.service.drafter_server import DrafterServer
from dflash.service.parts import build_draft_sessions
from dflash.service.session_store import MemorySessionStore
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray_internals import controller_policy, deployment_id, replica_id
from service_fixtures import BLOCK_SIZE, model_dirs  # noqa: F401

DRAFTER = deployment_id("drafter", app_name="dflash")


def context(inflight, *, target=2, lo=1, hi=8, policy_kwargs=None, **config):
    """A Serve AutoscalingContext whose replicas report `inflight` drafts each (None: nothing reported yet)."""
    replicas = [replica_id(f"r{i}", DRAFTER) for i in range(target if inflight is None else len(inflight))]
    metrics = {} if inflight is None else {INFLIGHT_DRAFTS: dict(zip(replicas, inflight)),
                                           HOT_SESSIONS: {r: 3.0 for r in replicas}}
    return AutoscalingContext(
        deployment_id=DRAFTER, deployment_name="drafter", app_name="dflash",
        current_num_replicas=len(replicas), target_num_replicas=target, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=AutoscalingConfig(min_replicas=lo, max_replicas=hi, **config, policy={
            "policy_function": POLICY_FUNCTION, "policy_kwargs": policy_kwargs or {}}),
    )


@pytest.mark.parametrize("inflight, expected", [
    ([6.0, 6.0], 6.0),    # 12 in flight, 2 per replica: scale up
    ([2.0, 2.0], 2.0),    # on target: stay
    ([0.5, 0.0], 1.0),    # nearly idle: down, but not below min_replicas
    ([0.0, 0.0], 1.0),    # idle
    ([40.0, 40.0], 8.0),  # overloaded: up, but not above max_replicas
])
def test_policy_asks_for_the_fleets_load_over_the_target(inflight, expected):
    desired, state = DraftLoadPolicy(target_inflight_drafts=2)(context(inflight))
    assert desired == pytest.approx(expected) and state == {}


def test_policy_holds_until_replicas_report():
    assert DraftLoadPolicy()(context(None, target=3))[0] == 3


def test_policy_rejects_a_bad_target():
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="target_inflight_drafts"):
            DraftLoadPolicy(target_inflight_drafts=bad)


def test_serve_applies_its_delays_and_bounds_to_the_policy():
    """The controller's own path (private in Ray 2.60, ray_internals.controller_policy): the config's policy
    built with its kwargs, wrapped with Serve's scaling factors and upscale/downscale delays."""

    def decide(inflight, **config):
        ctx = context(inflight, policy_kwargs={"target_inflight_drafts": 4}, **config)
        return controller_policy(ctx.config.policy)(ctx)[0]

    assert decide([20.0, 20.0], upscale_delay_s=0) == 8  # 40 drafts / 4 per replica, capped at max 8
    assert decide([10.0, 10.0], upscale_delay_s=0, upscaling_factor=0.5) == 4  # halfway from 2 to 5 (rounded up)
    assert decide([10.0, 10.0], upscale_delay_s=30) == 2  # load must last upscale_delay_s first
    assert decide([0.0, 0.0], downscale_delay_s=600) == 2  # idle must last downscale_delay_s first
    assert decide([0.0, 0.0], downscale_delay_s=0) == 1


# --- wiring: the drafter's options and config checks --------------------------------------------------

def test_drafter_autoscaling_uses_the_draft_load_policy():
    config = ServiceConfig.from_dict({"mode": "disaggregated", "drafter": {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 5,
        "policy": {"policy_kwargs": {"target_inflight_drafts": 3}}}},
        "verifier": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}})
    auto = config.serve_options("drafter")["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 5, "policy": {
        "policy_function": POLICY_FUNCTION, "policy_kwargs": {"target_inflight_drafts": 3}}}
    assert config.drafter.autoscaling_config.get("policy") == {"policy_kwargs": {"target_inflight_drafts": 3}}
    assert "policy" not in config.serve_options("verifier")["autoscaling_config"]  # Serve's own policy
    assert AutoscalingConfig.model_validate(auto).policy.policy_function == POLICY_FUNCTION
    assert ServiceConfig.from_dict(config.to_dict()) == config

    own = {"max_replicas": 2, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    kept = ServiceConfig.from_dict({"drafter": {"autoscaling_config": own}}).serve_options("drafter")
    assert kept["autoscaling_config"] == own
    assert ServiceConfig.from_dict({"drafter": {"num_replicas": 2}}).serve_options("drafter")["num_replicas"] == 2


@pytest.mark.parametrize("auto, named", [
    ({"max_replica": 4}, "drafter.autoscaling_config.max_replica: unknown Ray Serve autoscaling key"),
    ({"max_replicas": "many"}, "drafter.autoscaling_config.max_replicas: Input should be a valid integer"),
    ({"policy": {"policy_fn": "x"}}, "drafter.autoscaling_config.policy.policy_fn: unknown"),
    ({"policy": {"policy_kwargs": {"target_inflight": 2}}},
     "drafter.autoscaling_config.policy.policy_kwargs: .*target_inflight"),
    ({"policy": {"policy_kwargs": {"target_inflight_drafts": 0}}}, "policy_kwargs: target_inflight_drafts: must be"),
    ({"policy": {"policy_function": "no_such_module:f"}}, "policy.policy_function: ModuleNotFoundError"),
    ({"min_replicas": 0, "max_replicas": 2}, "drafter.autoscaling_config.min_replicas: must be >= 1"),
])
def test_bad_drafter_autoscaling_names_the_key(auto, named):
    with pytest.raises(ConfigError, match=named):
        ServiceConfig.from_dict({"mode": "disaggregated", "drafter": {"autoscaling_config": auto}})


# --- the load a drafter replica reports ----------------------------------------------------------------

def test_drafter_server_counts_drafts_in_flight_and_hot_sessions(model_dirs):
    target, drafter = model_dirs
    config = ServiceConfig.from_dict({"mode": "disaggregated", "model": {
        "target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32"}})
    store = MemorySessionStore()
    sessions = build_draft_sessions(config)
    server = DrafterServer(sessions, store).start()
    width = len(sessions.drafter.target_layer_ids) * sessions.drafter.model.config.hidden_size
    replies = []
    try:
        assert server.load() == {INFLIGHT_DRAFTS: 0.0, HOT_SESSIONS: 0.0}
        with grpc.insecure_channel(server.address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            chunks = list(codec.draft_request_chunks("s1", torch.randn(5, width), 0, 7, BLOCK_SIZE, 1 << 20))
            call = threading.Thread(target=lambda: replies.append(stub.DraftBatch(iter(chunks), timeout=60).replies[0]))
            with sessions._lock:  # the model is busy: the call waits, in flight
                call.start()
                deadline = time.monotonic() + 30
                while server.load()[INFLIGHT_DRAFTS] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server.load() == {INFLIGHT_DRAFTS: 1.0, HOT_SESSIONS: 0.0}
            call.join(timeout=60)
        assert len(replies) == 1 and len(replies[0].draft_token_ids) == BLOCK_SIZE - 1
        assert server.load() == {INFLIGHT_DRAFTS: 0.0, HOT_SESSIONS: 1.0}
        sessions.release("s1")
        assert server.load()[HOT_SESSIONS] == 0.0
    finally:
        server.stop()
