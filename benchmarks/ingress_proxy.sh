#!/usr/bin/env bash
# `dflash serve` behind each of its ingress proxies, a fresh service per pass, alternating (ray, haproxy,
# ray, haproxy, ...), each sweep beside the engine in process: what Serve's Python proxy costs per stream
# against Ray Serve's HAProxy mode (HAProxy relaying every call straight to the verifier replica's server).
#
#   bash benchmarks/ingress_proxy.sh [OUT_DIR] [CONCURRENCIES] [PASSES]   # default /tmp/ingress_proxy 1,8,16 2
#
# Prints one line per concurrency and run (`dflash bench --load`'s table rows, service then in process);
# the JSON of each run lands in OUT_DIR/pass<N>_<proxy>/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/ingress_proxy}
LOAD=${2:-1,8,16}
PASSES=${3:-2}
PORT=${PORT:-9000}
LOGS=$(mktemp -d)
mkdir -p "$OUT"

SERVE_PID=
stop_serve() {
  [ -n "$SERVE_PID" ] || return 0
  kill -TERM "$SERVE_PID" 2>/dev/null || true
  wait "$SERVE_PID" 2>/dev/null || true
  SERVE_PID=
}
trap stop_serve EXIT

for pass in $(seq 1 "$PASSES"); do
  for proxy in ray haproxy; do
    log="$LOGS/serve_${pass}_$proxy.log"
    dflash serve --port "$PORT" --ingress-proxy "$proxy" >"$log" 2>&1 &
    SERVE_PID=$!
    until grep -q "serving dflash.v1.Generation" "$log"; do
      kill -0 "$SERVE_PID" 2>/dev/null || { cat "$log" >&2; exit 1; }
      sleep 1
    done
    dflash bench --load "$LOAD" --service "127.0.0.1:$PORT" --in-process --max-new-tokens 128 \
      --out "$OUT/pass${pass}_$proxy" 2>/dev/null | grep "^| [0-9]" | sed "s/^/$proxy pass $pass /"
    stop_serve
  done
done
