"""`dflash tls-front`: TLS in front of a plaintext gRPC server; the Helm chart's head-pod sidecar."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..service.tls_front import TlsFront


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tls-front",
        help="terminate TLS on a port and forward every gRPC call to a plaintext server",
        description="Serves --listen with TLS and forwards every method (dflash.v1.Generation, health, "
        "reflection) to --upstream in plaintext: metadata, deadlines, status and streams pass unchanged. "
        "Certificate files are reread when they change. SIGTERM stops it. (`dflash serve` runs the same "
        "front itself when tls.cert_file is configured.)",
    )
    p.add_argument("--listen", default="0.0.0.0:9443", help="host:port served with TLS (default 0.0.0.0:9443)")
    p.add_argument("--upstream", default="127.0.0.1:9000",
                   help="host:port of the plaintext gRPC server, e.g. Ray Serve's proxy (default 127.0.0.1:9000)")
    p.add_argument("--cert", required=True, help="PEM certificate chain, leaf first (e.g. a Secret's tls.crt)")
    p.add_argument("--key", required=True, help="PEM private key of --cert (e.g. a Secret's tls.key)")
    p.add_argument("--client-ca", default="", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds calls in flight get to finish on SIGTERM")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from ..service.config import TlsConfig
    from ..service.tls_front import TlsFront

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    front = TlsFront(TlsConfig(cert_file=args.cert, key_file=args.key, client_ca_file=args.client_ca),
                     args.listen, args.upstream, args.grace)
    asyncio.run(_serve_until_signal(front))
    return 0


async def _serve_until_signal(front: TlsFront) -> None:
    import asyncio
    import signal

    await front.start()
    print(f"dflash: TLS on {front.listen} (port {front.port}) -> {front.upstream}; SIGTERM stops",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await front.stop()
