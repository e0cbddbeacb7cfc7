"""`dflash client "prompt"`: stream one generation from a running `dflash serve`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence

from ..errors import DFlashError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="stream a generation from a dflash server over gRPC")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--server", default="127.0.0.1:9000", help="host:port of the server (default 127.0.0.1:9000)")
    p.add_argument("--token", default="", help="bearer token when the server has auth on (or DFLASH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="connect over TLS, trusting gRPC's bundled root CAs")
    p.add_argument("--tls-ca", metavar="FILE", help="connect over TLS, trusting the PEM CA(s) in FILE (implies --tls)")
    p.add_argument("--tls-server-name", metavar="NAME", default="",
                   help="check the server's certificate against NAME instead of the --server host (implies --tls)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="verify only the leading drafts the drafter is jointly this confident in (0: whole block)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os

    import grpc

    from ..service.client import GenerationClient

    fields = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "stop": args.stop}
    for name in ("temperature", "top_p", "top_k", "seed", "block_size", "draft_confidence"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    final, rounds = None, []
    if bool(args.tls_cert) != bool(args.tls_key):
        raise DFlashError("--tls-cert and --tls-key: give both (the client certificate and its key) or neither")
    root = _read(args.tls_ca, "--tls-ca") if args.tls_ca else None
    client_certificate = ((_read(args.tls_key, "--tls-key"), _read(args.tls_cert, "--tls-cert"))
                          if args.tls_cert else None)
    with GenerationClient(args.server, args.token or os.environ.get("DFLASH_TOKEN", ""), root,
                          tls=args.tls or bool(args.tls_server_name), server_name=args.tls_server_name,
                          client_certificate=client_certificate) as client:
        try:
            for chunk in client.generate(**fields):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                rounds += chunk.rounds
                if chunk.HasField("final"):
                    final = chunk.final
        except grpc.RpcError as exc:
            raise DFlashError(f"{exc.code().name}: {exc.details()}") from None
    sys.stdout.write("\n")
    if final is not None:
        print(f"[{final.usage.completion_tokens} tokens, finish={final.finish_reason}] tau={final.tau:.2f} "
              f"over {final.rounds} rounds{round_breakdown(rounds)} | decode {final.decode_tokens_per_s:.1f} tok/s",
              file=sys.stderr)
    return 0


def round_breakdown(rounds: Sequence) -> str:
    """What the verify policy did with a stream's decoding rounds (RoundStats messages), for its summary
    line: " (drafted 30 at tau 3.10; 70 plain: measured faster 62, exploring 8)". Empty when every round
    drafted, or none did."""
    decoding = [r for r in rounds if r.index > 0]
    drafted = [r for r in decoding if r.draft_tokens > 0]
    # A plain round's reason "best": the policy measured plain decoding faster at this batch size.
    plain = Counter("measured faster" if r.policy_reason == "best" else r.policy_reason or "plain"
                    for r in decoding if r.draft_tokens == 0)
    if not drafted or not plain:
        return ""
    why = ", ".join(f"{reason} {n}" for reason, n in plain.most_common())
    tau = sum(r.committed for r in drafted) / len(drafted)
    return f" (drafted {len(drafted)} at tau {tau:.2f}; {sum(plain.values())} plain: {why})"


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DFlashError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
