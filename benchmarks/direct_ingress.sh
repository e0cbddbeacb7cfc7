#!/usr/bin/env bash
# The same `dflash serve` reached through Ray Serve's gRPC proxy (the public port) and straight at the
# verifier replica's own gRPC server (Ray's direct ingress, RAY_SERVE_ENABLE_DIRECT_INGRESS=1), the
# two alternating on one running service: what the proxy hop costs per stream.
#
#   bash benchmarks/direct_ingress.sh [OUT_DIR] [CONCURRENCIES] [PASSES]   # default /tmp/direct_ingress 8,16 2
#
# Direct ingress is Ray 2.60's (replica.py `_maybe_start_direct_ingress_servers`): each ingress replica
# serves the app's gRPC servicers on a port of its own (40000-41000), found here in Serve's replica log.
# The proxy keeps the public port, so both paths are measured against the same replica.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/direct_ingress}
LOAD=${2:-8,16}
PASSES=${3:-2}
PORT=${PORT:-9000}
LOGS=$(mktemp -d)
mkdir -p "$OUT"

RAY_SERVE_ENABLE_DIRECT_INGRESS=1 dflash serve --port "$PORT" >"$LOGS/dflash-serve.log" 2>&1 &
SERVE_PID=$!
trap 'kill -TERM $SERVE_PID 2>/dev/null || true; wait $SERVE_PID 2>/dev/null || true' EXIT
until grep -q "serving dflash.v1.Generation" "$LOGS/dflash-serve.log"; do
  kill -0 $SERVE_PID 2>/dev/null || { cat "$LOGS/dflash-serve.log" >&2; exit 1; }
  sleep 1
done
DIRECT=$(grep -h "dflash_verifier.*Successfully started RequestProtocol.GRPC server on port" \
  /tmp/ray/session_latest/logs/serve/*.log | tail -1 | grep -o '[0-9]*$')
echo "proxy at 127.0.0.1:$PORT, verifier replica's own gRPC server at 127.0.0.1:$DIRECT" >&2

for pass in $(seq 1 "$PASSES"); do
  for path in proxy direct; do
    port=$PORT; [ $path = direct ] && port=$DIRECT
    dflash bench --load "$LOAD" --service "127.0.0.1:$port" --max-new-tokens 128 --out "$OUT/pass${pass}_$path" \
      2>/dev/null | grep "^| [0-9]" | sed "s/^/$path pass $pass /"
  done
done
