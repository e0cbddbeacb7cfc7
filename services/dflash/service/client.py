"""A small Python client for dflash.v1.Generation (used by `dflash client` and the tests)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from ..api.v1 import generate_pb2, generate_pb2_grpc


class GenerationClient:
    """Streams Generate chunks; `resume` reconnects to a session with the count of tokens received."""

    def __init__(self, target: str = "127.0.0.1:9000", token: str = "", root_certificates: bytes | None = None,
                 timeout_s: float | None = None, *, tls: bool = False, server_name: str = "",
                 client_certificate: tuple[bytes, bytes] | None = None) -> None:
        """TLS when `tls`, root_certificates (PEM CAs to trust; None: gRPC's bundled roots) or
        client_certificate ((PEM key, PEM chain), for mutual TLS) is given; server_name checks the
        server's certificate against that name instead of the target's host."""
        if tls or root_certificates is not None or client_certificate is not None:
            key, chain = client_certificate or (None, None)
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates, key, chain),
                                               options)
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout_s = timeout_s

    def generate(self, request: generate_pb2.GenerateRequest | None = None,
                 **fields: object) -> Iterator[generate_pb2.GenerateChunk]:
        request = request or generate_pb2.GenerateRequest(**fields)
        return self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout_s)

    def resume(self, session_id: str, tokens_received: int) -> Iterator[generate_pb2.GenerateChunk]:
        return self.generate(session_id=session_id, tokens_received=tokens_received)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
