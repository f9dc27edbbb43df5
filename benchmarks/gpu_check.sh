#!/usr/bin/env bash
# Issue 53's GPU check, prepared: two calls of at most 6 minutes each (every command is under a time cap, and
# each part ends within 360 s, its setup included; GPU_CHECK_BUDGET=S sets another), so that a 15-minute device
# lease holds the machine's start (a minute or two) and both parts. Part 1 is what decides the issue (the
# update at >= 35% MFU on equal lengths); part 2 is the rest. Each section has its own cap; the last section of
# a part gets what is left.
#   bash benchmarks/gpu_check.sh "$OUT"                   # part 1: the head; the passes and levers, equal lengths
#   GPU_CHECK_PART=2 bash benchmarks/gpu_check.sh "$OUT"  # part 2: tests, recompiles, smoke, references, long tail
# Part 1 (issue 53's items 1 and 2, equal lengths):
#   1. the head: benchmarks/logprobs.py at 16,384 tokens, V 151,936, bf16, hidden 2,048 (naive, the head as
#      the trainer runs it, and TRL 1.16's fused head where trl imports) and 4,096 (naive, the head); cap 60 s;
#   2. the trainer's passes: benchmarks/train_passes.py at Qwen3-1.7B's shape, 64 samples, prompt 256,
#      responses of 1,024 (equal lengths: the issue's target), --reps 1 after a warm-up: the old pass and the
#      update with the default settings (layers compiled on CUDA, full checkpointing, the trainer's cut,
#      --micro-tokens 16,384), then each lever alone against them (MFU, tokens/s, peak memory), those that
#      may reach 35% first: no_checkpointing, micro_tokens_x2, selective_checkpointing and
#      no_checkpointing+micro_tokens_x2 (about 84 GiB: an H100 cannot hold it, its row says OOM and the run
#      goes on; it comes after selective_checkpointing so that an OOM cannot disturb that row); then
#      micro_tokens_x4, fewest_micro_batches and eager_layers, which decide nothing but need this run's
#      model and batch, and here cost no second model build and compile. compile_layers is not run: on CUDA
#      it is the base. The rest of the part (about 270 s): a build (saving the random checkpoint on a fresh
#      machine) and the base's compiles (tens of seconds), about 8 s a lever (0.55 s old pass, 3 s update,
#      each twice), and a recompile of the layers' training graph for each lever that changes checkpointing.
#      If the compiles run slow, the last levers are cut; each lever's table prints as it ends.
# Part 2 (items 3 to 8, and item 2 on long-tailed lengths):
#   3. on the tests' tiny Qwen3 (tests/reference.toy_model, hidden 128, trained on the CPU while the setup
#      runs), five jobs at once, cap 150 s: they check correctness, not speed, so they share the device and
#      the cores (the smoke test's GPU memory, which nvidia-smi polls, then counts the others' too):
#      a. issue 53's selection of tests/test_trainer.py, -k "compiled_layers or trains_as_with_eager", on
#         this device, in two pytest processes: the compiled-against-eager test (the bf16 gap; its bf16 half
#         did not finish inside a 90 s cap on the H200), which the conftest runs last, in one; the others (the
#         unchanged-policy ratio with compiled fp32 and bf16 layers, "compiled bf16: ratio 1 in N
#         micro-batches; sync probe gap ...", and the variants the trainer's call pattern compiles) in the
#         other. Their printed lines and pass/fail counts go to the summary;
#      b. stapo.py for 2 bf16 steps, layers compiled (--compile-layers on, --engine hf), under
#         TORCH_LOGS=recompiles,graph_breaks: its exact command line; the log's "Recompiling function" lines
#         by function (the layers' is run_layer in policy.py) and graph breaks (a break inside a layer would
#         run part of it eager, which eager_layer_calls does not count); each metrics row's
#         eager_layer_calls (0: every layer call ran compiled) and sync_probe_gap_mean / sync_probe_gap;
#      c. the same with --checkpointing selective: whether part 1's selective lever ran compiled (torch warns
#         once that a selective checkpoint's context_fn is compiled; the summary counts that warning);
#      d. examples/gpu_smoke.py --engine hf (its commands' logs in FOLDER/smoke_logs.txt);
#   4. the update against the full-logits reference, layers compiled on both sides, and the profile of one
#      update (--profile update: the kernels' share of the update's time, by kind, and the operators that take
#      the most of it): train_passes.py on equal lengths, no levers, full_logits before the update so that
#      the profile is what a cap would cut; cap 80 s;
#   5. the passes on long-tailed responses (log-normal, median 1,024, 200..8,192, seed 0) with the default
#      settings and each lever alone: fewest_micro_batches, no_checkpointing, selective_checkpointing,
#      micro_tokens_x2, micro_tokens_x4, eager_layers; cap 130 s where TRL's update follows, else the rest;
#   6. where `from trl import GRPOTrainer` works, TRL 1.16's own update on the same model and equal-length
#      rows (phase trl_update, in a process of its own): the rest.
# What does not fit: part 2 as listed needs more than its 360 s, about 400 to 450 s by the estimates above, on
# a machine that kept part 1's compile cache and 1.7B checkpoint (each train_passes.py run pays a model build
# and its compiles, and TRL's update loads the model again in fp32 on top; on a fresh machine more), so
# its last command, TRL's update, runs only when the tiny checks end early (they take the 150 s of their cap
# only on a slow start), and on a slow start the long tail's last levers (eager_layers, then micro_tokens_x4)
# go too. They are what decides least: TRL's update is TRL's code, unchanged since its head was compared,
# and eager layers on the long tail were measured at 4cd143f (docs/performance.md). A command cut by its cap,
# or not started for want of time, says so in the log ("[cut at its cap", "[not run").
# Each part prints its sections' tables, then a summary, and writes everything to FOLDER/gpu_check.log
# (part 2: FOLDER/gpu_check_2.log). The 1.7B model's random checkpoint is kept in /tmp/gpu_check_model for
# the next part on the same machine.
#
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh /tmp/gc   # on CPU: tiny shapes, every section end to end
#   (part 1 about 75 s; part 2 about 18 minutes, most of it inductor compiling C++ for the bf16 runs, on the
#   2-core machine shared with another CPU-heavy job)
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
  budget=2400 cap_head=300 cap_toy=900 cap_tiny=1200 cap_ref=200 cap_long=300
else
  head_args=(--batch 8 --seq 2048 --vocab 151936)
  h1=2048 h2=4096 shape=1.7b
  passes=(--samples 64 --prompt 256 --response 1024 --micro-tokens 16384 --reps 1)
  budget=360 cap_head=60 cap_toy=120 cap_tiny=150 cap_ref=80 cap_long=130
fi
budget=${GPU_CHECK_BUDGET:-$budget}  # seconds for the part, setup included
passes=(--shape $shape "${passes[@]}" --model-dir /tmp/gpu_check_model/$shape)  # kept for the next part
# Every command runs under a time cap, and the part ends within its budget: a section gets its own cap or
# what is left of the budget, whichever is less; the last section of a part gets all that is left. A command
# cut by its cap, or not started for lack of time, says so.
left() { local l=$((budget - SECONDS)); [ $l -lt ${1:-$l} ] && echo $l || echo ${1:-$l}; }
capped() {
  local t rc; t=$(left "$1"); shift
  if [ "$t" -le 5 ]; then echo "[not run: ${t}s left of the part's ${budget}s] ${*:1:4}"; return 125; fi
  timeout -k 10 "$t" "$@"; rc=$?
  [ $rc = 124 ] || [ $rc = 137 ] && echo "[cut at its cap of ${t}s] ${*:1:4}"
  return $rc
}
section() { echo; echo "==== $1 ($(date +%T), ${SECONDS}s of ${budget}s)"; }
build_toy() {  # the tests' tiny Qwen3 at hidden 128 (head_dim 32): $1/model, $1/train.jsonl, $1/judge.txt
  capped "$2" "$PY" - "$1" <<'EOF'
import os, sys
sys.path.insert(0, "tests")
from reference import toy_model
toy_model(sys.argv[1], hidden=128)
open(os.path.join(sys.argv[1], "judge.txt"), "w").write("Q:{question} G:{gold_answer} R:{llm_response} V:")
print("toy model in", sys.argv[1])
EOF
}

if [ "$part" = 2 ]; then  # the toy model trains on the CPU while the setup below runs
  build_toy "$work/toy" $cap_toy >"$work/toy.txt" 2>&1 &
  toy_pid=$!
fi
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
touch "$work"/{head1,head2,passes,test,recompiles_full,recompiles_selective,smoke,refs,long,trl}.txt

# A 2-step bf16 stapo.py run of the toy with compiled layers, under TORCH_LOGS=recompiles,graph_breaks: its
# command line, its log's "Recompiling function" lines by function and its graph breaks, each metrics row's
# eager_layer_calls and sync probe gaps. $1: a name (full, selective); the rest: stapo.py's extra flags.
recompiles() {
  local name=$1 run=$work/recompiles_$1; shift
  local cmd=("$PY" stapo.py --model "$work/toy/model" --dataset "$work/toy/train.jsonl" --out "$run" --steps 2
             --dtype bf16 --compile-layers on --engine hf --prompts-per-step 8 --group-size 4 --minibatches 2
             --micro-tokens 256 --max-prompt-len 64 --max-response-len 16 --save-every 0 --warmup-steps 0 "$@")
  echo "command: TORCH_LOGS=recompiles,graph_breaks $(printf '%q ' "${cmd[@]}")"
  capped "$cap_tiny" env TORCH_LOGS=recompiles,graph_breaks "${cmd[@]}" >"$run.log" 2>&1
  echo "exit $?"
  "$PY" - "$name" "$run" <<'EOF'
import collections, json, os, re, sys
name, run = sys.argv[1:]
text = open(run + ".log", errors="replace").read().replace("\r", "\n")
recompiled = re.findall(r"Recompiling function (\S+) in (\S+)", text)
by = collections.Counter(f"{f} ({os.path.basename(w)})" for f, w in recompiled)
breaks = [line for line in text.splitlines() if re.search(r"(?i)graph break", line)]
said = [line for line in text.splitlines() if "decoder-layer calls ran eager" in line]
selective = text.count("context_fn is passed to torch.utils.checkpoint under torch.compile")  # torch's warning
print(f"recompiles {name}: {len(recompiled)} 'Recompiling function' lines"
      + (": " + ", ".join(f"{n} x {f}" for f, n in by.items()) if by else "")
      + f"; {len(breaks)} graph-break lines; {len(said)} 'ran eager' warnings; torch's warning that a "
      f"selective checkpoint's context_fn is compiled: {selective}")
for line in breaks[:3] + said[:2]:
    print(f"recompiles {name}:   {line.strip()[:300]}")
path = os.path.join(run, "metrics.jsonl")
rows = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
print(f"recompiles {name}: {len(rows)} metrics rows" + ("" if rows else f" (no {path})"))
for r in rows:
    print(f"recompiles {name}: step {r.get('step')}: eager_layer_calls {r.get('eager_layer_calls', 'ABSENT')}, "
          f"sync_probe_gap_mean {r.get('sync_probe_gap_mean')}, sync_probe_gap {r.get('sync_probe_gap')}, "
          f"step_s {r.get('step_s')}")
EOF
  echo "---- the log's recompile and graph-break lines (the first 60)"
  tr '\r' '\n' <"$run.log" | grep -i -A4 "Recompiling function\|graph break" | cut -c1-300 | head -n 60
  echo "---- the log's last 15 lines"
  tr '\r' '\n' <"$run.log" | grep -v "__recompiles\|^\s*$" | tail -n 15 | cut -c1-300
}

if [ "$part" = 1 ]; then
  section "1. the head: benchmarks/logprobs.py"
  t0=$SECONDS
  variants=naive,chunked
  grep -q "^probe trl_head yes" "$work/machine.txt" && variants=$variants,trl
  capped $cap_head "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h1 --variants $variants \
    | tee "$work/head1.txt"
  capped $((cap_head - (SECONDS - t0))) "$PY" benchmarks/logprobs.py "${head_args[@]}" --hidden $h2 \
    --variants naive,chunked | tee "$work/head2.txt"

  section "2. the trainer's passes, equal lengths, the base and each lever: benchmarks/train_passes.py"
  levers=no_checkpointing,micro_tokens_x2,selective_checkpointing,no_checkpointing+micro_tokens_x2
  levers=$levers,micro_tokens_x4,fewest_micro_batches,eager_layers
  capped "" "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal --phases old_pass,update \
    --levers $levers | tee "$work/passes.txt"
else
  section "3. the tiny Qwen3's checks, at once: the compiled-layers tests, two stapo.py runs' recompiles, the smoke"
  wait $toy_pid
  cat "$work/toy.txt"
  t0=$SECONDS
  pids=()
  # issue 53's selection, -k "compiled_layers or trains_as_with_eager", in two processes at once: the
  # conftest runs the slow tests first, so in one process the compiled-against-eager test (the bf16 gap,
  # which did not finish inside a 90 s cap on the H200) would start last
  selection="compiled_layers or trains_as_with_eager"
  for k in "($selection) and not compute_what" "($selection) and compute_what"; do
    raw=$work/test_raw_${#pids[@]}.txt
    echo "command: $PY -m pytest -q -s -p no:cacheprovider tests/test_trainer.py -k \"$k\"" >"$raw"
    capped $cap_tiny "$PY" -m pytest -q -s -p no:cacheprovider tests/test_trainer.py -k "$k" >>"$raw" 2>&1 &
    pids+=($!)
  done
  recompiles full >"$work/recompiles_full.txt" 2>&1 &
  pids+=($!)
  recompiles selective --checkpointing selective >"$work/recompiles_selective.txt" 2>&1 &
  pids+=($!)
  dtype=bf16
  [ -n "${GPU_CHECK_TINY:-}" ] && dtype=auto
  capped $cap_tiny "$PY" examples/gpu_smoke.py --engine hf --dtype $dtype --model "$work/toy/model" \
    --out "$work/smoke" --max-prompt-len 128 --max-tokens 16 --judge-prompt "$work/toy/judge.txt" \
    >"$work/smoke.txt" 2>&1 &
  pids+=($!)
  wait "${pids[@]}"
  echo "the five jobs took $((SECONDS - t0)) s together"
  echo; echo "---- 3a. pytest tests/test_trainer.py -k \"$selection\", in two processes"
  cat "$work"/test_raw_[01].txt | tr '\r' '\n' | grep -v "^DEBUG\|it/s\]\|s/it\]\|^\s*$" >"$work/test.txt"
  cat "$work/test.txt"
  echo; echo "---- 3b. stapo.py, 2 bf16 steps, compiled layers"
  cat "$work/recompiles_full.txt"
  echo; echo "---- 3c. the same, --checkpointing selective"
  cat "$work/recompiles_selective.txt"
  echo; echo "---- 3d. examples/gpu_smoke.py --engine hf"
  cat "$work/smoke.txt"
  for f in "$work"/smoke/*.log; do
    [ -f "$f" ] && { echo "==== $f"; tail -n 60 "$f"; }
  done >"$out/smoke_logs.txt"

  trl=
  grep -q "^probe trl_update yes" "$work/machine.txt" && trl=yes
  section "4. the update against full logits, layers compiled on both; the update's profile: train_passes.py"
  capped $cap_ref "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal \
    --phases old_pass,full_logits,update --profile update | tee "$work/refs.txt"

  section "5. the passes on long-tailed lengths, the base and each lever: benchmarks/train_passes.py"
  levers=fewest_micro_batches,no_checkpointing,selective_checkpointing,micro_tokens_x2,micro_tokens_x4
  capped "${trl:+$cap_long}" "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths lognormal \
    --phases old_pass,update --levers $levers,eager_layers | tee "$work/long.txt"

  if [ -n "$trl" ]; then
    section "6. TRL 1.16's own update on the same model and rows: train_passes.py --phases trl_update"
    capped "" "$PY" benchmarks/train_passes.py "${passes[@]}" --lengths equal --phases trl_update \
      | tee "$work/trl.txt"
  else
    section "6. TRL 1.16's own update: not run (from trl import GRPOTrainer fails here; carry its wheels in .whl)"
  fi
fi

section "summary, part $part"
grep -h "tokens, vocab\|/naive:\|/trl:\|| failed: \|^{\"variant\"" "$work"/head*.txt
table="^| \(phase\|old_pass\|update\|full_logits\|trl_update\) "
grep -h "$table\|^update / \|samples, lengths .* --micro-tokens" "$work"/{passes,refs,long,trl}.txt
grep -h '"phase": "padding"\|"error"\|^\[cut at\|^\[not run' "$work"/{passes,refs,long,trl}.txt | cut -c1-300
grep -h '"phase": "profile"\|"phase": "trl_update"' "$work"/{refs,trl}.txt
grep -oh "compiled layers[ (].*\|compiled \(fp32\|bf16\): ratio.*\|bf16: gap.*\|^FAILED.*\|^ERROR.*" "$work/test.txt" \
  | cut -c1-300
grep -h "^command: \|[0-9] \(passed\|failed\)\|^\[cut at\|^\[not run" "$work/test.txt" | cut -c1-300
grep -h "^command: \|^exit \|^recompiles \|^\[cut at\|^\[not run" "$work"/recompiles_*.txt | cut -c1-400
grep -h "^smoke:\|^PASS\|^FAIL\|^SKIP\|^  ran \|^\[cut at\|^\[not run" "$work/smoke.txt"
echo "log: $log (${SECONDS}s)"
rm -rf "$work"
