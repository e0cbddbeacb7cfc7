#!/usr/bin/env bash
# Sets up this checkout and streams a generation from the built-in demo pair (DFlash vs target alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
prompt=${1:-"def fibonacci(n):"}
echo "== DFlash (block 16) =="
dflash generate "$prompt" --max-new-tokens 160
echo "== target alone (--block-size 1) =="
dflash generate "$prompt" --max-new-tokens 160 --block-size 1
