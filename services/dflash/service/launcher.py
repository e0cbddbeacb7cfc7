"""Everything on one machine: local Ray, a redis-server child (or the in-process store), the Serve app.

Used by `dflash serve` and by the service tests. On a cluster, the Helm chart deploys `app.build` through
KubeRay's serveConfigV2 instead, with the same configuration tree.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time

from .config import ServiceConfig, TlsConfig
from .redis_process import RedisProcess, free_port, redis_server_path
from .tls_front import FrontThread, TlsFront

log = logging.getLogger("dflash.service")


@dataclasses.dataclass
class LocalService:
    config: ServiceConfig
    redis: RedisProcess | None
    front: FrontThread | None = None  # the TLS front on the public port, when tls.cert_file is set

    @property
    def address(self) -> str:
        return f"{self.config.grpc_host}:{self.config.grpc_port}"

    def deploy(self, config: ServiceConfig, timeout_s: float = 180) -> None:
        """(Re)deploy the application with a new configuration (same Redis, same Ray)."""
        from ray import serve

        from .app import build

        config = dataclasses.replace(config, redis=dataclasses.replace(config.redis, url=self.config.redis.url))
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
        server = RedisProcess(tempfile.mkdtemp(prefix="dflash-redis-")).start()
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

    With TLS configured, the TLS front serves config.grpc_port and Serve's proxy listens in plaintext on
    tls.upstream_port (or a free port); Ray binds that on every interface, so keep it firewalled.
    """
    import ray
    from ray import serve

    from .app import grpc_options

    proxy, front = config, None
    if config.tls.enabled:
        proxy = dataclasses.replace(config, grpc_port=config.tls.upstream_port or free_port(), tls=TlsConfig())
        front = TlsFront(config.tls, f"{config.grpc_host}:{config.grpc_port}",
                         f"127.0.0.1:{proxy.grpc_port}")  # reads the certificates before Ray starts
    config, redis = resolve_redis(config)
    service = LocalService(config, redis)
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                    grpc_options=grpc_options(proxy))
        service.deploy(config, timeout_s)
        if front is not None:
            service.front = FrontThread(front).start()
    except BaseException:
        service.stop()
        raise
    return service


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
