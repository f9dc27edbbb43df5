#!/usr/bin/env bash
# Set up (once) and run the main job: the CPU toy, a tiny Qwen3 learning addition with STAPO, offline.
#   bash toy.sh                       # minutes on 2 cores; prints what S2T silenced, ends "toy: accuracy A -> B"
#   bash toy.sh --method all          # any examples/toy.py flag passes through
# Needs only Python 3.11. The virtual environment is .venv; a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")"
. ./setup.sh requirements.txt
exec python examples/toy.py "$@"
