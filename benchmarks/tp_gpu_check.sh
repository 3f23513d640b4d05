#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU machine, end to end, in one command (under 9.5 minutes):
#   1. `tinypaged bench throughput --model-shape llama3-8b -tp N` (it used to hang at exit);
#   2. benchmarks/tp_check.py: greedy tokens at TP=N against TP=1 (tiny models, Llama-3-8B
#      shape), a worker killed mid-decode (--kill-check), a module-level script and
#      `tinypaged serve -tp N` each ended by SIGINT and by SIGTERM, an LLM dropped without
#      shutdown() (--signal-check);
# after each, no process may still hold a GPU (nvidia-smi). Logs go to $OUT (or /tmp); the last
# lines printed are the summary.
#
#     bash benchmarks/tp_gpu_check.sh        # TP=2; `bash benchmarks/tp_gpu_check.sh 4` on 4 GPUs
#     TINYPAGED_PIECEWISE_UNCHECKED=1 bash benchmarks/tp_gpu_check.sh   # the same with piecewise
#         CUDA graphs captured at TP=N too (the check that would lift their TP exclusion)
#     STEPS=tp_check CHECK_LIMIT=560 bash benchmarks/tp_gpu_check.sh     # one step, its own limit
#         (a fresh machine compiles every kernel once: give tp_check a call of its own there)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.
TP=${1:-2}
LOGS=${OUT:-/tmp}/tp-gpu-check
mkdir -p "$LOGS"
SUMMARY=()

gpu_processes() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; }

# check NAME LIMIT_S COMMAND...: run it under a time limit, then wait up to 15 s for the GPUs to
# be free; leftovers are reported, then killed so that the next step starts clean.
check() {
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  for _ in $(seq 15); do left=$(gpu_processes); [ -z "$left" ] && break; sleep 1; done
  SUMMARY+=("$name: exit $rc after $(( $(date +%s) - start )) s; GPU processes after it: ${left:-none}")
  for pid in $(echo "$left" | cut -d, -f1); do kill -9 "$pid" 2>/dev/null; done
  echo "== $name (exit $rc), last lines of $LOGS/$name.log:"
  tail -n 25 "$LOGS/$name.log"
}

STEPS=${STEPS:-bench tp_check}
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
if [[ " $STEPS " == *" bench "* ]]; then
  check bench_tp "${BENCH_LIMIT:-150}" python -m tinypaged bench throughput \
    --model-shape llama3-8b -tp "$TP" --json "$LOGS/bench_tp$TP.json"
fi
if [[ " $STEPS " == *" tp_check "* ]]; then
  check tp_check "${CHECK_LIMIT:-400}" python benchmarks/tp_check.py --tp "$TP" \
    --dtypes bfloat16 --kill-check --signal-check
fi
echo "== summary (TP=$TP; exit 124 = over its time limit, 3 = a hang caught by tp_check)"
printf '%s\n' "${SUMMARY[@]}"
