#!/usr/bin/env bash
# Issue 42's GPU check, prepared: two calls of at most 6 minutes each (every command is under a time cap, and
# each part ends within 360 s, its setup included), so that a 15-minute device lease holds the machine's start
# and both parts, or one part twice. Part 1 is the check the issue asks for; part 2 answers what part 1 leaves
# open. Each section has its own cap; the last section of a part gets whatever time is left.
#   bash benchmarks/gpu_check.sh "$OUT"                     # part 1: the head, the passes, the smoke test
#   GPU_CHECK_PART=2 bash benchmarks/gpu_check.sh "$OUT"    # part 2: the tests, the cuts, the profile, TRL
# Part 1:
#   1. the head: benchmarks/logprobs.py at 16,384 tokens, V 151,936, bf16, hidden 2,048 (naive, the head as
#      the trainer runs it, and TRL 1.16's fused head where trl imports) and 4,096 (naive, the head);
#   2. the trainer's passes: benchmarks/train_passes.py at Qwen3-1.7B's shape, 64 samples, prompt 256,
#      responses of 1,024 (equal lengths: the issue's 35% target): the old pass, the update and the
#      full-logits reference update, then the update with checkpointing off and micro-batches twice as
#      long (the one combination the H200's rows say may reach 35% MFU; its peak, about 84 GiB, is more than
#      an H100 holds: there its row says OOM);
#   3. examples/gpu_smoke.py --engine hf with the tests' tiny Qwen3 (tests/reference.toy_model, hidden 128).
# Part 2:
#   4. the compiled decoder layers against the eager ones, in fp32 and bf16 (inductor's GPU kernels: the test
#      tests/test_trainer.py::test_compiled_layers_compute_what_the_eager_layers_do, run on the GPU);
#   5. one run of train_passes.py on long-tailed responses (log-normal, median 1,024, 200..8,192) and equal
#      ones: the cheapest cut (a GPU run's) against the fewest micro-batches (a CPU run's) on the long tail,
#      and its padding; where the update's time goes (--profile update: the kernels' share of the update's
#      time, by kind, and the operators that take the most of it); and, where TRL imports, TRL 1.16's own
#      update on the same model and equal-length rows (phase trl_update).
# Each part prints its sections' tables, then a summary, and writes everything to FOLDER/gpu_check.log
# (part 2: FOLDER/gpu_check_2.log; the smoke test's command logs in FOLDER/smoke_logs.txt). The 1.7B model's
# random checkpoint is kept in /tmp/gpu_check_model for the next part on the same machine.
#
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh /tmp/gc   # on CPU: tiny shapes, end to end (~90 s a part)
#
# The GPU image lacked datasets, dill and multiprocess (problems.py reads a .parquet or Hub dataset through
# datasets; the check's .jsonl runs do not), trl (the TRL rows) and accelerate, psutil and jinja2 (with trl,
# TRL's update): carry them as wheels in .whl (see docs/performance.md); the script installs whatever .whl
# holds into /tmp/site first, and prints the version of each package they import (or MISSING).
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh FOLDER}
part=${GPU_CHECK_PART:-1}
[ "$part" = 1 ] || [ "$part" = 2 ] || { echo "GPU_CHECK_PART=$part: 1 or 2"; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
[ "$part" = 2 ] && log=$out/gpu_check_2.log
work=$(mktemp -d /tmp/gpu_check.XXXXXX)
: >"$log"
exec > >(tee -a "$log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

if [ -n "${GPU_CHECK_TINY:-}" ]; then  # the CPU rehearsal: every command, at shapes that run in seconds
  head_args=(--batch 2 --seq 128 --vocab 3000)
  h1=64 h2=96 shape=tiny
  passes=(--samples 16 --prompt 16 --response 32 --micro-tokens 1024 --reps 1)
  budget=900 cap_head=150 cap_passes=240 cap_test=300
else
  head_args=(--batch 8 --seq 2048 --vocab 151936)
  h1=2048 h2=4096 shape=1.7b
  passes=(--samples 64 --prompt 256 --response 1024 --micro-tokens 16384 --reps 1)
  budget=360 cap_head=60 cap_passes=150 cap_test=130
fi
budget=${GPU_CHECK_BUDGET:-$budget}  # seconds for the part, setup included
passes=(--shape $shape "${passes[@]}" --model-dir /tmp/gpu_check_model/$shape)  # kept for the next part
# Every command runs under a time cap, and the part ends within its budget: a section gets its own cap or
# what is left of the budget, whichever is less; the last section of a part gets all that is left.
left() { local l=$((budget - SECONDS)); [ $l -lt ${1:-$l} ] && echo $l || echo ${1:-$l}; }
capped() { local t; t=$(left "$1"); shift; [ "$t" -gt 5 ] && timeout -k 10 "$t" "$@"; }
section() { echo; echo "==== $1 ($(date +%T), ${SECONDS}s of ${budget}s)"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  capped 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
section "the machine, part $part"
capped 20 nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
capped 60 "$PY" - >"$work/machine.txt" 2>&1 <<'EOF'
import importlib, importlib.metadata, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("transformers", "triton", "datasets", "dill", "multiprocess", "pyarrow", "pandas", "xxhash",
             "fsspec", "trl", "accelerate"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", None) or importlib.metadata.version(name))
    except Exception as e:
        print(name, "MISSING:", type(e).__name__, e)
probes = {"trl_head": "import trl.kernels.chunked_logprob", "trl_update": "from trl import GRPOTrainer"}
for probe, code in probes.items():
    try:
        exec(code)
        print("probe", probe, "yes")
    except Exception as e:
        print("probe", probe, "no:", type(e).__name__, str(e)[:200])
EOF
cat "$work/machine.txt"
echo "git: $(git rev-parse --short HEAD 2>/dev/null)," \
  "$(git status --short 2>/dev/null | wc -l) files changed or new"
touch "$work"/{test,head1,head2,passes,more,smoke}.txt

if [ "$part" = 1 ]; then
  section "1. the head: benchmarks/logprobs.py"
  t0=$SECONDS
  variants=naive,chunked
  grep -q "^probe trl_head yes" "$work/machine.txt" && variants=$variants,trl
  capped $cap_head "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h1 --variants $variants \
    | tee "$work/head1.txt"
  capped $((cap_head - (SECONDS - t0))) "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h2 \
    --variants naive,chunked | tee "$work/head2.txt"

  section "2. the trainer's passes: benchmarks/train_passes.py"
  capped $cap_passes "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal \
    --levers no_checkpointing+micro_tokens_x2 | tee "$work/passes.txt"

  section "3. examples/gpu_smoke.py --engine hf"
  capped "" "$PY" - "$work/toy" <<'EOF'
import os, sys
sys.path.insert(0, "tests")
from reference import toy_model
toy_model(sys.argv[1], hidden=128)
open(os.path.join(sys.argv[1], "judge.txt"), "w").write("Q:{question} G:{gold_answer} R:{llm_response} V:")
print("toy model in", sys.argv[1])
EOF
  dtype=bf16
  [ -n "${GPU_CHECK_TINY:-}" ] && dtype=auto
  capped "" "$PY" examples/gpu_smoke.py --engine hf --dtype $dtype --model "$work/toy/model" \
    --out "$work/smoke" --max-prompt-len 128 --max-tokens 16 --judge-prompt "$work/toy/judge.txt" \
    | tee "$work/smoke.txt"
  for f in "$work"/smoke/*.log; do
    [ -f "$f" ] && { echo "==== $f"; tail -n 60 "$f"; }
  done >"$out/smoke_logs.txt"
else
  section "4. the compiled layers against eager: pytest on this device"
  capped $cap_test "$PY" -m pytest -q -s -p no:cacheprovider tests/test_trainer.py -k compiled_layers 2>&1 \
    | grep -v "^DEBUG" | tee "$work/test.txt" | tail -n 5

  section "5. the cuts, where the update's time goes, TRL's update: benchmarks/train_passes.py"
  trl=
  grep -q "^probe trl_update yes" "$work/machine.txt" && trl=,trl_update
  capped "" "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths lognormal,equal \
    --phases old_pass,update$trl --levers fewest_micro_batches --profile update | tee "$work/more.txt"
fi

section "summary, part $part"
grep -h "compiled layers (\|bf16: gap\| passed\| failed" "$work/test.txt"
grep -h "tokens, vocab\|/naive:\|/trl:\|| failed: \|^{\"variant\"" "$work"/head*.txt
table="^| \(phase\|old_pass\|update\|full_logits\|trl_update\) "
grep -h "$table\|^update / \|samples, lengths .* --micro-tokens" "$work/passes.txt" "$work/more.txt"
grep -h '"phase": "padding"\|"error"' "$work/passes.txt" "$work/more.txt" | cut -c1-300
grep -h '"phase": "profile"\|"phase": "trl_update"' "$work/more.txt"
grep -h "^smoke:\|^PASS\|^FAIL\|^SKIP" "$work/smoke.txt"
echo "log: $log (${SECONDS}s)"
rm -rf "$work"
