#!/usr/bin/env bash
# Our service beside vLLM's CPU build serving the same demo pair with DFlash, and beside our own engine
# in process: one `dflash bench --load` sweep, the same prompts and load shape for all, ratios printed.
#
#   bash benchmarks/serving_vs_peer.sh [OUT_DIR] [CONCURRENCIES]     # default docs/results/serving 1,8,16
#   SERVE_ARGS="--ingress-proxy haproxy" bash benchmarks/serving_vs_peer.sh ...   # other `dflash serve` flags
#
# Needs ../shared/peers/vllm-cpu (sets vLLM up in KIT=/tmp/vllm-kit, ~3 min the first time). Both servers
# stay up for the sweep and are stopped at the end; each is idle while the other is measured.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/serving}
LOAD=${2:-1,8,16}
KIT=${KIT:-/tmp/vllm-kit}
PEER=../shared/peers/vllm-cpu
TARGET=services/dflash/assets/demo/target
DRAFTER=services/dflash/assets/demo/drafter
LOGS=$(mktemp -d)

bash "$PEER/setup.sh" "$KIT" >"$LOGS/vllm-setup.log" 2>&1
read -r _ VLLM_URL VLLM_PID < <(bash "$PEER/serve.sh" "$KIT" "$TARGET" "$DRAFTER" | grep '^READY')
echo "vLLM (DFlash, $DRAFTER) at $VLLM_URL, pid $VLLM_PID" >&2

# shellcheck disable=SC2086  # SERVE_ARGS: several flags
dflash serve --port "${PORT:-9000}" --openai-port "${OPENAI_PORT:-8000}" ${SERVE_ARGS:-} >"$LOGS/dflash-serve.log" 2>&1 &
SERVE_PID=$!
trap 'kill -TERM $SERVE_PID 2>/dev/null || true; kill -TERM -- -$VLLM_PID 2>/dev/null || true; wait $SERVE_PID 2>/dev/null || true' EXIT
until grep -q "serving dflash.v1.Generation" "$LOGS/dflash-serve.log"; do
  kill -0 $SERVE_PID 2>/dev/null || { cat "$LOGS/dflash-serve.log" >&2; exit 1; }
  sleep 1
done

dflash bench --load "$LOAD" --service "127.0.0.1:${PORT:-9000}" --openai "vllm-dflash=$VLLM_URL/v1" --in-process \
  --max-new-tokens 128 --out "$OUT"
