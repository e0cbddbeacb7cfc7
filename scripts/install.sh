#!/usr/bin/env bash
# Installs everything dflash needs on a fresh machine (Debian, Python 3.11, root or sudo-less root).
# torch comes FIRST and pinned: the CPU wheel 2.13.0 lies on this machine's disk, and letting a
# bare `torch` requirement resolve first would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  "$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"

# The service's session store (dflash serve starts it; the service tests start their own).
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
fi
