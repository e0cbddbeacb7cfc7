"""TLS on the public gRPC port: a grpc.aio server that terminates TLS and forwards every call to a
plaintext gRPC server (Ray Serve's proxy, on loopback or in the same pod).

Ray Serve's gRPC proxy has no TLS setting, so `dflash serve` (with `tls.cert_file`) and the Helm chart's
head-pod sidecar (`dflash tls-front`) put this in front of it. The front knows no service: each call is
forwarded as a bidirectional stream of undecoded messages, which carries unary, server-streaming and
bidirectional methods alike (the wire format is the same), so Generate, health and reflection all pass.
Request metadata (the bearer token) and the deadline go upstream; response metadata, status code and
details come back unchanged; chunks are relayed as they arrive; a client that goes away cancels the
upstream call. Certificate files are reread when they change (a renewed Kubernetes Secret).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterable

import grpc

from .config import ConfigError, TlsConfig

log = logging.getLogger("dflash.tls")

# Set by gRPC itself on each hop; forwarding them would duplicate or contradict the new hop's own.
_HOP_METADATA = ("user-agent", "content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding")


def _read_pem(path: str, field: str, marker: bytes) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or marker not in data:
        raise ConfigError(f"{field}: {path} holds no PEM {marker.decode().strip('- ')} block")
    return data


def certificate_configuration(tls: TlsConfig) -> grpc.ServerCertificateConfiguration:
    """The server's key, certificate chain and (for mutual TLS) client CA, read and checked now."""
    chain = _read_pem(tls.cert_file, "tls.cert_file", b"CERTIFICATE-----")
    key = _read_pem(tls.key_file, "tls.key_file", b"PRIVATE KEY-----")
    client_ca = _read_pem(tls.client_ca_file, "tls.client_ca_file", b"CERTIFICATE-----") if tls.client_ca_file else None
    return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=client_ca)


class _Certificates:
    """Hands gRPC a new certificate configuration when a file changed (checked before each handshake)."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self.stamp = self._stamp()
        self.initial = certificate_configuration(tls)

    def _stamp(self) -> tuple:
        paths = (self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file)
        try:  # os.stat follows the symlinks a Secret volume swaps on renewal
            return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in paths if p))
        except OSError:
            return ()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stamp()
        if not stamp or stamp == self.stamp:
            return None
        try:
            configuration = certificate_configuration(self.tls)
        except ConfigError as exc:  # half-written files: keep serving the old certificate, try again next time
            log.warning("dflash tls: keeping the current certificate: %s", exc)
            return None
        self.stamp = stamp
        log.info("dflash tls: certificate files changed; new connections use the new certificate")
        return configuration


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS credentials from the config's files; raises ConfigError naming an unreadable or non-PEM file."""
    if not tls.enabled:
        raise ConfigError("tls.cert_file: is empty; TLS needs a certificate chain and a key")
    certificates = _Certificates(tls)
    return grpc.dynamic_ssl_server_credentials(certificates.initial, certificates.fetch,
                                               require_client_authentication=bool(tls.client_ca_file))


class TlsFront:
    """Listens with TLS on `listen` (host:port) and forwards every method to `upstream` (plaintext)."""

    def __init__(self, tls: TlsConfig, listen: str, upstream: str, grace_s: float = 5.0) -> None:
        self.credentials = server_credentials(tls)  # file problems surface here, before anything listens
        self.listen = listen
        self.upstream = upstream
        self.grace_s = grace_s
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        self.channel = grpc.aio.insecure_channel(self.upstream)
        # Without SO_REUSEPORT a second server on a taken port fails instead of sharing its connections.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((_Forwarder(self.channel),))
        try:
            self.port = self.server.add_secure_port(self.listen, self.credentials)
        except RuntimeError as exc:
            raise ConfigError(f"tls: cannot listen on {self.listen}: {exc}") from None
        await self.server.start()
        log.info("dflash tls: %s (TLS) -> %s", self.listen, self.upstream)
        return self.port

    async def stop(self) -> None:
        """Stop accepting calls; calls in flight get grace_s to finish, then are cancelled."""
        if self.server is not None:
            await self.server.stop(self.grace_s)
        if self.channel is not None:
            await self.channel.close()


class _Forwarder(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        # No (de)serializers: messages cross as the bytes they arrived as.
        upstream = self.channel.stream_stream(method)

        async def forward(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = upstream(requests, metadata=_forwardable(context.invocation_metadata()),
                            timeout=context.time_remaining())
            try:
                await context.send_initial_metadata(_forwardable(await call.initial_metadata()))
                async for response in call:
                    yield response
                context.set_trailing_metadata(_forwardable(await call.trailing_metadata()))
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "", _forwardable(err.trailing_metadata()))
            finally:
                call.cancel()  # a no-op once the call is done; stops the upstream when the client left

        return grpc.stream_stream_rpc_method_handler(forward)


def _forwardable(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if not k.startswith(":") and k not in _HOP_METADATA)


class FrontThread:
    """A TlsFront on its own event loop in a daemon thread, for callers without one (`dflash serve`)."""

    def __init__(self, front: TlsFront) -> None:
        self.front = front
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="dflash-tls-front")

    def start(self, timeout_s: float = 30) -> FrontThread:
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.front.start(), self.loop).result(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def port(self) -> int:
        return self.front.port

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.front.stop(), self.loop).result(self.front.grace_s + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
