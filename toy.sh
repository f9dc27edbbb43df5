#!/usr/bin/env bash
# Set up (once) and run the main job: the CPU toy, a tiny Qwen3 learning to carry, offline, under STAPO and under
# JustRL from one warm start, side by side (one process on one thread each).
#   bash toy.sh                 # minutes on 2 cores; ends "toy: stapo accuracy A -> B", "toy: justrl accuracy A -> C"
#   bash toy.sh --method stapo  # one arm alone, "toy: accuracy A -> B"; any examples/toy.py flag passes through
# Needs only Python 3.11. The virtual environment is .venv; a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")"
. ./setup.sh requirements.txt
exec python examples/toy.py "$@"
