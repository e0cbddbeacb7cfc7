#!/usr/bin/env bash
# Regenerate services/dflash/api/**/_pb2*.py from protos/ (needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gen_protos.py "$@"
