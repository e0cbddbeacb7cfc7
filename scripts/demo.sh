#!/usr/bin/env bash
# Sets up this machine, serves the built-in demo pair (local Ray Serve + Redis + gRPC on 127.0.0.1:9000)
# and streams one generation from it with `dflash client`; then stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
prompt=${1:-"def read_csv(path):"}
log=$(mktemp -t dflash-serve.XXXXXX.log)
dflash serve > "$log" 2>&1 &
server=$!
trap 'echo "stopping dflash serve ..."; kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
echo "starting dflash serve (log: $log) ..."
for _ in $(seq 1 150); do
  if dflash client "x" --max-new-tokens 1 > /dev/null 2>&1; then break; fi
  if ! kill -0 $server 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 2
done
dflash client "$prompt" --max-new-tokens 160
