#!/usr/bin/env bash
# Issue 42's GPU check, one prepared command: about 8 minutes on one H100 or H200 (estimated from an H200's
# sections on 2026-11-27; they are capped at 150, 120, 150 and 180 s, at most 10 minutes in all):
#   0. the compiled decoder layers against the eager ones, in fp32 and bf16 (inductor's GPU kernels: the test
#      tests/test_trainer.py::test_compiled_layers_compute_what_the_eager_layers_do, run on the GPU);
#   1. the head: benchmarks/logprobs.py at 16,384 tokens, V 151,936, bf16, hidden 2,048 (naive, the head as
#      the trainer runs it, its eager buffered passes, and TRL 1.16's fused head where trl imports) and 4,096
#      (naive, the head);
#   2. the trainer's passes: benchmarks/train_passes.py at Qwen3-1.7B's shape, 64 samples, prompt 256,
#      long-tailed responses (log-normal, median 1,024, 200..8,192) and equal ones of 1,024, in the
#      micro-batches a GPU run cuts (the cheapest) and, on the long tail, the fewest that fit (CPU's cut);
#   2b. with GPU_CHECK_LEVERS=1 (120 s more): the levers, each alone against the base on the same model
#      (train_passes.py --levers, equal lengths): the layers eager, checkpointing off, micro-batches 4x
#      larger, and checkpointing off with micro-batches 2x larger;
#   2c. with GPU_CHECK_PROFILE=1 (180 s more): where the update's time goes (train_passes.py --profile update,
#      equal lengths): the kernels' share of the wall time, by kind, and the operators that take the most of
#      it; and, where TRL imports, TRL 1.16's own update on the same model and rows (phase trl_update);
#   3. examples/gpu_smoke.py --engine hf with the tests' tiny Qwen3 (tests/reference.toy_model, hidden 128).
# It prints each section's table, then a summary, and writes everything to FOLDER/gpu_check.log (with the
# smoke test's command logs in FOLDER/smoke_logs.txt).
#
#   bash benchmarks/gpu_check.sh "$OUT"                       # on the GPU machine, from the repository root
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh /tmp/gc     # on CPU: tiny shapes, end to end (~3 minutes)
#
# The GPU image lacks datasets, dill and multiprocess (problems.py reads a .parquet or Hub dataset through
# datasets; the check's .jsonl runs do not), trl (section 1's TRL row) and accelerate, psutil and jinja2 (with
# trl, section 2c's TRL update): carry them as wheels in .whl (see docs/performance.md); the script installs
# whatever .whl holds into /tmp/site first.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh FOLDER}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
work=$(mktemp -d /tmp/gpu_check.XXXXXX)
: >"$log"
exec > >(tee -a "$log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ -n "${GPU_CHECK_TINY:-}" ]; then  # the CPU rehearsal: every command, at shapes that run in seconds
  head_args=(--batch 2 --seq 128 --vocab 3000)
  h1=64 h2=96
  passes=(--shape tiny --samples 16 --prompt 16 --response 32 --micro-tokens 1024 --reps 1)
  cap_test=300 cap_head=150 cap_passes=200 cap_levers=300 cap_profile=200 cap_smoke=400
else
  head_args=(--batch 8 --seq 2048 --vocab 151936)
  h1=2048 h2=4096
  passes=(--shape 1.7b --samples 64 --prompt 256 --response 1024 --micro-tokens 16384 --reps 1)
  cap_test=150 cap_head=120 cap_passes=150 cap_levers=120 cap_profile=180 cap_smoke=180
fi

section() { echo; echo "==== $1 ($(date +%T))"; }
section "the machine"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
"$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("transformers", "triton", "datasets", "dill", "multiprocess", "trl", "accelerate"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "MISSING:", type(e).__name__, e)
EOF
echo "git: $(git rev-parse --short HEAD 2>/dev/null)," \
  "$(git status --short 2>/dev/null | wc -l) files changed or new"

section "0. the compiled layers against eager: pytest on this device"
timeout $cap_test "$PY" -m pytest -q -s -p no:cacheprovider tests/test_trainer.py -k compiled_layers 2>&1 \
  | grep -v "^DEBUG" | tee "$work/test.txt" | tail -n 5

section "1. the head: benchmarks/logprobs.py"
t0=$SECONDS
variants=naive,chunked,eager
"$PY" -c "import trl.kernels.chunked_logprob" 2>/dev/null && variants=$variants,trl
timeout $cap_head "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h1 --variants $variants \
  | tee "$work/head1.txt"
left=$((cap_head - (SECONDS - t0)))
[ $left -gt 20 ] && timeout $left "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h2 \
  --variants naive,chunked | tee "$work/head2.txt"

section "2. the trainer's passes: benchmarks/train_passes.py"
timeout $cap_passes "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths lognormal,equal \
  --levers fewest_micro_batches --model-dir "$work/model" | tee "$work/passes.txt"

[ -n "${GPU_CHECK_LEVERS:-}" ] && section "2b. the levers: benchmarks/train_passes.py --levers" &&
timeout $cap_levers "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal --phases old_pass,update \
  --levers eager_layers,no_checkpointing,micro_tokens_x4,no_checkpointing+micro_tokens_x2 \
  --model-dir "$work/model" | tee "$work/levers.txt"
touch "$work/levers.txt"

trl=
"$PY" -c "from trl import GRPOTrainer" >/dev/null 2>&1 && trl=,trl_update
[ -n "${GPU_CHECK_PROFILE:-}" ] && section "2c. where the update's time goes: train_passes.py --profile" &&
timeout $cap_profile "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal --phases update$trl \
  --profile update --model-dir "$work/model" | tee "$work/profile.txt"
touch "$work/profile.txt"

section "3. examples/gpu_smoke.py --engine hf"
timeout $cap_smoke "$PY" - "$work/toy" <<'EOF'
import os, sys
sys.path.insert(0, "tests")
from reference import toy_model
toy_model(sys.argv[1], hidden=128)
open(os.path.join(sys.argv[1], "judge.txt"), "w").write("Q:{question} G:{gold_answer} R:{llm_response} V:")
print("toy model in", sys.argv[1])
EOF
dtype=bf16
[ -n "${GPU_CHECK_TINY:-}" ] && dtype=auto
timeout $cap_smoke "$PY" examples/gpu_smoke.py --engine hf --dtype $dtype --model "$work/toy/model" \
  --out "$work/smoke" --max-prompt-len 128 --max-tokens 16 --judge-prompt "$work/toy/judge.txt" \
  | tee "$work/smoke.txt"
for f in "$work"/smoke/*.log; do
  [ -f "$f" ] && { echo "==== $f"; tail -n 60 "$f"; }
done >"$out/smoke_logs.txt"

section "summary"
grep -h "compiled layers (\|bf16: gap\| passed\| failed" "$work/test.txt"
grep -h "tokens, vocab\|/naive:\|/trl:" "$work"/head*.txt
table="^| \(phase\|old_pass\|update\|full_logits\|trl_update\) "
grep -h "$table\|^update / \|samples, lengths .* --micro-tokens" "$work/passes.txt" "$work/levers.txt" \
  "$work/profile.txt"
grep -h '"phase": "padding"' "$work/passes.txt" | cut -c1-200
grep -h '"phase": "profile"\|"phase": "trl_update"' "$work/profile.txt"
grep -h "^smoke:\|^PASS\|^FAIL" "$work/smoke.txt"
echo "log: $log"
rm -rf "$work"
