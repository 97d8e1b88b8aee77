#!/usr/bin/env bash
# Every benchmark in bench/ on this machine's CPU, in under 10 minutes on 2 cores, and bench/RESULTS.md from the
# run: the machine, the date, each exact command, its tables (ours against transformers / peft / TRL or a naive
# baseline, the ratio, the target met or missed) and, where a target is missed, the profile of our side.
#   pip install -r requirements.txt -r bench/requirements.txt
#   bash bench/run_all.sh                       # NOTE="..." adds a line to the header (a shared machine, say)
# One torch thread by default (OMP_NUM_THREADS=1): on a machine that other jobs share, a second thread mostly
# measures waiting for a core. MELD for bench_verifier.py comes from CLUE_DATA_DIR (default ../shared/data);
# bench_rollout.py's vLLM server from the venv VLLM_VENV names (default .venv-vllm: `bash .ci/vllm_venv.sh`).
# A benchmark whose input is missing is skipped, and says so in RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
export CLUE_DATA_DIR=${CLUE_DATA_DIR:-../shared/data}
export VLLM_VENV=${VLLM_VENV:-$PWD/.venv-vllm}
threads=$OMP_NUM_THREADS
benchmarks=(
  "python bench/bench_generate.py --threads $threads --profile"
  "python bench/bench_logprobs.py --methods naive ours --repeats 0"
  "python bench/bench_sft.py --threads $threads --profile"
  "python bench/bench_grpo.py --threads $threads --profile"
  "python bench/bench_packing.py --threads $threads"
  "python bench/bench_decode.py --threads $threads"
  "python bench/bench_decode.py --threads $threads --lora 16 --dtype bfloat16"
  "python bench/bench_train_step.py --threads $threads"
  "python bench/bench_verifier.py --data $CLUE_DATA_DIR"
  "python bench/bench_verifier_bounds.py"
  "python bench/bench_judge.py"
  "python bench/bench_fsdp.py --layers 12 --repeats 2"
  "python bench/bench_sync.py"
  "python bench/bench_rollout.py --threads $threads"
  "python bench/gpu.py --paper"
)
# The hand-written analysis at the end of RESULTS.md (from its "## Where a target is missed" heading on) is kept.
analysis=$(sed -n '/^## Where a target is missed/,$p' bench/RESULTS.md 2>/dev/null)
logs=$(mktemp -d)
start=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
failed=0
body=""
for i in "${!benchmarks[@]}"; do
  cmd=${benchmarks[$i]}
  name=$(echo "$cmd" | awk '{print $2}')
  echo "[$((i + 1))/${#benchmarks[@]}] $cmd" >&2
  skip=""
  if [[ $name == bench/bench_verifier.py && ! -f $CLUE_DATA_DIR/meld/train_sent_emo.csv ]]; then
    skip="MELD not found under CLUE_DATA_DIR=$CLUE_DATA_DIR."
  elif [[ $name == bench/bench_rollout.py ]] && ! "$VLLM_VENV/bin/python" -c \
      "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
    skip="no vLLM venv at VLLM_VENV=$VLLM_VENV (build it with \`bash .ci/vllm_venv.sh\`)."
  fi
  if [[ -n $skip ]]; then
    echo "  skipped: $skip" >&2
    body+=$'\n'"## $name"$'\n\n'"Skipped: $skip"$'\n'
    continue
  fi
  t0=$(date +%s)
  timeout 600 $cmd >"$logs/$i.out" 2>"$logs/$i.err"
  rc=$?
  seconds=$(($(date +%s) - t0))
  body+=$'\n'"## $name"$'\n\n'"\`$cmd\` (${seconds} s)"$'\n\n'
  if [[ $rc -ne 0 ]]; then
    failed=1
    body+="FAILED (exit $rc); the end of its error output:"$'\n\n```\n'"$(tail -n 20 "$logs/$i.err")"$'\n```\n'
  elif grep -q '^|' "$logs/$i.out"; then  # Markdown tables: kept as they are, verdicts as list items
    body+="$(sed -E 's/^target: (.*)$/\n- target: \1\n/' "$logs/$i.out")"$'\n'
  else
    body+=$'```\n'"$(cat "$logs/$i.out")"$'\n```\n'
  fi
done
verdicts=$(cat "$logs"/*.out 2>/dev/null | grep '^target: ' | sed -E \
  -e 's/^target: (.*) ([0-9.]+x) \(goal >= ([0-9.]+x)\): (met|MISSED)$/| \1 | \2 | >= \3 | \4 |/' \
  -e 's/^target: (.*) ([0-9.]+) \(goal ([0-9.]+)\): (met|MISSED)$/| \1 | \2 | \3 | \4 |/')
versions=$(python -c "import importlib.metadata as m, platform; print(f'Python {platform.python_version()}, ' + ', '.join(
    f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'peft', 'trl')))")
{
  echo "# Benchmarks"
  echo
  echo "Written by \`bash bench/run_all.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') in $(($(date +%s) - start)) s at commit" \
    "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench/RESULTS.md' || echo ' (with uncommitted changes)')."
  echo
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(getconf _NPROCESSORS_ONLN) cores," \
    "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo) RAM, $threads torch thread(s) per benchmark;" \
    "load average (1, 5, 15 min) $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end. $versions."
  [[ -n ${NOTE:-} ]] && echo && echo "$NOTE"
  echo
  echo "Each benchmark times both sides in the same process, alternating, so load from other jobs falls on both;"
  echo "compare the ratios, not the absolute numbers. Targets (from the issues) and whether this run met them:"
  echo
  echo "| benchmark | measured | target | |"
  echo "|---|---|---|---|"
  echo "$verdicts"
  echo "$body"
  [[ -n $analysis ]] && echo && echo "$analysis"
} >bench/RESULTS.md
echo "wrote bench/RESULTS.md in $(($(date +%s) - start)) s" >&2
exit $failed
