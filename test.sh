#!/usr/bin/env bash
# Set up (once) and run the tests: the CPU install, vLLM's CPU build (the real engine) and TRL, then pytest.
#   bash test.sh                      # about 9 minutes on 2 quiet cores (README), the install included the first time
#   bash test.sh -k vllm              # any pytest flag passes through
# Needs only Python 3.11. The virtual environment is .venv (shared with toy.sh); a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")"
. ./setup.sh requirements-dev.txt
# One thread per process: two workers on two cores; a thread pool per worker spins against the other's
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -n 2 --dist loadgroup "$@"
