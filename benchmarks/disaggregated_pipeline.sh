#!/usr/bin/env bash
# Drafting beside verification, measured through the service: the same `dflash bench --load` sweep
# (DFlash and target-only, the same prompts) against four deployments of the demo pair, one after the
# other on this machine, each replica on one torch thread (what Ray gives a 0.5-CPU replica):
#   colocated        the default: the drafter inside the verifier replica, serial step
#   disagg-serial    one drafter replica, scheduler.pipeline_drafts=off
#   disagg-auto      one drafter replica, the default: the adaptive policy's `piped` arm where it measures better
#   disagg-piped     one drafter replica, pipeline_drafts=on: every drafting step pipelined
# then prints each one's aggregate tok/s and its ratios to the co-located default and to its own target-only.
#
#   bash benchmarks/disaggregated_pipeline.sh [OUT_DIR] [CONCURRENCIES]   # default docs/results/pipeline 1,8
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/pipeline}
LOAD=${2:-1,8}
PORT=${PORT:-9400}
LOGS=$(mktemp -d)

run() {  # name, environment, serve flags
  local name=$1 envs=$2 flags=$3
  env $envs dflash serve $flags --port "$PORT" --no-openai >"$LOGS/$name.log" 2>&1 &
  local pid=$!
  until grep -q "serving dflash.v1.Generation" "$LOGS/$name.log"; do
    kill -0 $pid 2>/dev/null || { cat "$LOGS/$name.log" >&2; exit 1; }
    sleep 1
  done
  dflash bench --load "$LOAD" --service "127.0.0.1:$PORT" --max-new-tokens 128 --out "$OUT/$name" >"$LOGS/$name.bench" 2>&1
  kill -TERM $pid; wait $pid 2>/dev/null || true
  sleep 3
}

run colocated "PIPELINE=default" ""
run disagg-serial "DFLASH_SCHEDULER__PIPELINE_DRAFTS=off" "--mode disaggregated --drafter-replicas 1"
run disagg-auto "PIPELINE=default" "--mode disaggregated --drafter-replicas 1"
run disagg-piped "DFLASH_SCHEDULER__PIPELINE_DRAFTS=on" "--mode disaggregated --drafter-replicas 1"

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
names = ["colocated", "disagg-serial", "disagg-auto", "disagg-piped"]
cells = {n: {(c["method"], c["concurrency"]): c for c in json.load(open(f"{out}/{n}/load.json"))["cells"]} for n in names}
base = cells["colocated"]
print("| deployment | streams | DFlash tok/s | tau | target-only tok/s | DFlash / co-located DFlash | DFlash / own target-only |")
print("|---|---|---|---|---|---|---|")
for n in names:
    for (method, c), cell in sorted(cells[n].items(), key=lambda kv: kv[0][1]):
        if method != "dflash":
            continue
        plain = cells[n][("target-only", c)]["tokens_per_s"]
        print(f"| {n} | {c} | {cell['tokens_per_s']:.0f} | {cell['tau']:.2f} | {plain:.0f} | "
              f"{cell['tokens_per_s'] / base[('dflash', c)]['tokens_per_s']:.2f}x | {cell['tokens_per_s'] / plain:.2f}x |")
EOF
