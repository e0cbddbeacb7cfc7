"""Who may call a drafter replica: the internal Drafter API's shared bearer token and optional mutual TLS.

A replica checks `authorization: Bearer <drafter_net.token>` on every call (`TokenCheck`) before any
of its code runs and answers UNAUTHENTICATED otherwise; the verifier sends the token with every call
(`call_metadata`). With drafter_net.tls_* set, both ends also speak TLS and each accepts only a peer
whose certificate the configured CA signed.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc

from .config import ConfigError, DrafterNetConfig

log = logging.getLogger("dflash.service")

_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call that does not carry the shared token (UNAUTHENTICATED), before its request is
    read or decoded."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if handler is None or hmac.compare_digest(str(sent).encode(), self._expected):
            return handler

        def deny(_request: object, context: grpc.ServicerContext) -> NoReturn:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "authorization: the internal Drafter API needs the shared token (drafter_net.token)")

        return _HANDLERS[(handler.request_streaming, handler.response_streaming)](deny)


def call_metadata(net: DrafterNetConfig) -> tuple[tuple[str, str], ...]:
    """What the verifier adds to every call."""
    return (("authorization", f"Bearer {net.token}"),) if net.token else ()


def server_credentials(net: DrafterNetConfig) -> grpc.ServerCredentials | None:
    """The replica's TLS credentials (client certificates required), or None for plaintext."""
    if not net.tls:
        return None
    return grpc.ssl_server_credentials([(_read(net, "tls_key_file"), _read(net, "tls_cert_file"))],
                                       root_certificates=_read(net, "tls_ca_file"), require_client_auth=True)


def channel_credentials(net: DrafterNetConfig) -> grpc.ChannelCredentials | None:
    """The verifier's TLS credentials (its certificate, the CA it trusts), or None for plaintext."""
    if not net.tls:
        return None
    return grpc.ssl_channel_credentials(_read(net, "tls_ca_file"), _read(net, "tls_key_file"),
                                        _read(net, "tls_cert_file"))


def channel_options(net: DrafterNetConfig) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", net.tls_server_name)] if net.tls and net.tls_server_name else []


def warn_if_open(net: DrafterNetConfig, address: str) -> None:
    if not net.token and not net.tls:
        log.warning("drafter_net.token is empty and mutual TLS is off: the internal Drafter API on %s accepts "
                    "any caller that reaches it", address)


def _read(net: DrafterNetConfig, key: str) -> bytes:
    path = getattr(net, key)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"drafter_net.{key}: cannot read {path}: {exc.strerror or exc}") from None
