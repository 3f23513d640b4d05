#!/usr/bin/env bash
# Online serving on one GPU: `tinypaged serve` (and, with VLLM=1, `vllm serve`) on random weights
# in the Llama-3-8B shape, loaded by `tinypaged bench serve` at 4, 16 and 64 requests/s.
#
#     bash benchmarks/serve_compare.sh                 # tinypaged only, ~1.5 min on an H200
#     VLLM=1 bash benchmarks/serve_compare.sh          # then vLLM from /tmp/vsite, ~5 min in all
#
# Both run the engine in a process of its own beside the API server's (tinypaged's default on a
# GPU, engine/core.py; TINYPAGED_ENABLE_MULTIPROCESSING=0 puts it back in a thread).
#
# Both servers read the same folder (tinypaged.bench.model_shapes: config.json of the shape and a
# one-word-per-id tokenizer of its 128,256 ids, --load-format dummy), take the same limits, and
# see the same requests: random token-id prompts, RANDOM_INPUT_LEN in, RANDOM_OUTPUT_LEN out with
# ignore_eos, Poisson arrivals, RATE * DURATION requests per rate. Each run draws its prompts from
# a seed of its own (probe 101, warm-up 102, a rate R run R), so no timed prompt is a prefix-cache
# hit left by an earlier run; both servers keep prefix caching on (their default). Each server
# first answers a correctness probe (a completion of the right length) and a warm-up burst, then
# the timed runs;
# it is stopped with SIGTERM (its process group is killed if it has not exited 30 s later; no
# other process is touched).
# Prints one table at the end; the JSON of every run lands in $OUT (or /tmp/serve-compare).
#
# Knobs (environment): SHAPE (llama3-8b), RATES ("4 16 64"), DURATION (s per rate, 20),
# RANDOM_INPUT_LEN (256), RANDOM_OUTPUT_LEN (128), VLLM (unset), VLLM_SITE (/tmp/vsite);
# MODEL_DIR, DTYPE, MAX_MODEL_LEN replace the shape's folder, bfloat16, 2048 (a dry run on a CPU);
# TINYPAGED_ARGS adds flags to `tinypaged serve` only (e.g. "--cudagraph-mode FULL_DECODE_ONLY").
set -u
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
SHAPE=${SHAPE:-llama3-8b}
RATES=${RATES:-4 16 64}
DURATION=${DURATION:-20}
IN_LEN=${RANDOM_INPUT_LEN:-256}
OUT_LEN=${RANDOM_OUTPUT_LEN:-128}
LOGS=${OUT:-/tmp}/serve-compare
mkdir -p "$LOGS"
ulimit -n 65536 2>/dev/null  # a server that falls behind holds one connection per waiting request
# The same limits for both engines (vLLM's serve defaults on an H200 where it has one).
LIMITS=(--dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_MODEL_LEN:-2048}" --max-num-seqs 256
        --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --served-model-name "$SHAPE"
        --seed 0)
# A server runs in a session of its own; whatever ends this script (an error, SIGTERM from a
# timeout) ends the server too, so no process is left holding the GPU.
SERVER_PID="" SERVER_LOG=""
on_exit() {
  [ -z "$SERVER_PID" ] && return
  echo "ended early; the server's last lines ($SERVER_LOG):"
  tail -n 15 "$SERVER_LOG"
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
}
trap on_exit EXIT
trap 'exit 143' TERM INT

python -c "import starlette, uvicorn" || {
  echo "tinypaged serve needs starlette and uvicorn: pip install them (wheels) first"; exit 1; }
# `vllm serve` imports more than offline vLLM (uvicorn, watchfiles, prometheus-fastapi-
# instrumentator, model-hosting-container-standards + jmespath): find out now, not after the
# tinypaged half.
if [ -n "${VLLM:-}" ]; then
  PYTHONPATH="${VLLM_SITE:-/tmp/vsite}" python -c "import uvicorn, vllm.entrypoints.openai.api_server
import vllm.entrypoints.serve.instrumentator.metrics" || {
    echo "vllm serve cannot import its API server (the error above names the missing module):"
    echo "install its wheels into ${VLLM_SITE:-/tmp/vsite} with pip --no-deps --target"; exit 1; }
fi
MODEL_DIR=${MODEL_DIR:-$(python -c "from tinypaged.bench.model_shapes import shape_dir
print(shape_dir('$SHAPE', tokenizer=True))")} || exit 1
echo "model folder: $MODEL_DIR ($SHAPE, dummy weights)"
nvidia-smi -i "${CUDA_VISIBLE_DEVICES:-0}" --query-gpu=name,memory.used --format=csv,noheader \
  2>/dev/null

# wait_ready PORT PID LIMIT_S: until /health answers 200; fails if the server died or took longer.
wait_ready() {
  local start=$SECONDS
  until python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=1)" \
      2>/dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "the server exited during startup"; return 1; }
    (( SECONDS - start > $3 )) && { echo "the server was not ready after $3 s"; return 1; }
    sleep 1
  done
  echo "ready after $(( SECONDS - start )) s"
}

# stop PID: SIGTERM, then its whole process group (the server and any child of it) 30 s later;
# then waits up to 15 s for the group to be gone. Only this server's processes are ever killed:
# other jobs may share the machine.
stop() {
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  if kill -0 "$1" 2>/dev/null; then
    echo "still running 30 s after SIGTERM: killing its process group"
    kill -KILL -- "-$1" 2>/dev/null
  fi
  wait "$1" 2>/dev/null
  echo "server exit status $?"
  for _ in $(seq 15); do pgrep -g "$1" >/dev/null || break; sleep 1; done
  if pgrep -g "$1" >/dev/null; then
    echo "processes of the server left after it exited: $(pgrep -g "$1" | tr '\n' ' ')"
    kill -KILL -- "-$1" 2>/dev/null
  fi
  SERVER_PID=""
  nvidia-smi -i "${CUDA_VISIBLE_DEVICES:-0}" --query-gpu=memory.used --format=csv,noheader \
    2>/dev/null | sed 's/^/GPU memory in use after the stop: /'
}

# bench NAME PORT SEED ARGS...: bench serve against the server on PORT (prompts and arrivals
# drawn from SEED), for 3 x DURATION + 60 s at most
bench() {
  local name=$1 port=$2 seed=$3
  shift 3
  timeout $(( 3 * DURATION + 60 )) python -m tinypaged bench serve --port "$port" \
    --model "$SHAPE" --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --ignore-eos \
    --seed "$seed" --result-dir "$LOGS" --result-filename "$name.json" --save-result "$@"
}

# run ENGINE PORT COMMAND...: start a server, probe it, warm it up, time each rate, stop it.
run() {
  local engine=$1 port=$2
  shift 2
  echo "== $engine: $*"
  SERVER_LOG=$LOGS/$engine-server.log
  setsid "$@" --port "$port" >"$SERVER_LOG" 2>&1 &
  local pid=$!
  SERVER_PID=$pid
  echo "server pid $pid (its own process group)"
  if ! wait_ready "$port" "$pid" 240; then
    tail -n 30 "$LOGS/$engine-server.log"; stop "$pid"; return 1
  fi
  # Correctness first: 2 requests must come back complete, with exactly OUT_LEN tokens each.
  if ! bench "$engine-probe" "$port" 101 --num-prompts 2 --request-rate inf >"$LOGS/$engine-probe.txt" \
      || ! python -c "import json, sys; r = json.load(open('$LOGS/$engine-probe.json'))
sys.exit(not (r['completed'] == 2 and r['output_lens'] == [$OUT_LEN] * 2))"; then
    echo "$engine failed the probe:"; cat "$LOGS/$engine-probe.txt"; stop "$pid"; return 1
  fi
  bench "$engine-warmup" "$port" 102 --num-prompts 64 --request-rate inf >/dev/null
  for rate in $RATES; do
    echo "-- $engine at $rate req/s"
    bench "$engine-$rate" "$port" "$rate" --num-prompts $(( rate * DURATION )) --request-rate "$rate"
  done
  stop "$pid"
}

run tinypaged 8100 python -m tinypaged serve "$MODEL_DIR" --load-format dummy "${LIMITS[@]}" \
  --log-level warning ${TINYPAGED_ARGS:-}
if [ -n "${VLLM:-}" ]; then
  # vLLM 0.20.2's `vllm serve`; like tinypaged's --log-level warning, no access-log line per
  # request. Its /v1/completions takes the same token-id prompts and ignore_eos.
  run vllm 8200 env PYTHONPATH="${VLLM_SITE:-/tmp/vsite}" python -m vllm.entrypoints.cli.main \
    serve "$MODEL_DIR" --load-format dummy "${LIMITS[@]}" --host 127.0.0.1 \
    --disable-uvicorn-access-log
fi

echo "== $SHAPE, $IN_LEN in / $OUT_LEN out, ignore_eos, ${DURATION} s per rate (ms: median / p99)"
python - "$LOGS" "$RATES" <<'EOF'
import json, os, sys
logs, rates = sys.argv[1], sys.argv[2].split()
print(f"{'engine':10} {'rate':>5} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT':>15} "
      f"{'TPOT':>13} {'ITL':>13}")
for engine in ("tinypaged", "vllm"):
    for rate in rates:
        path = os.path.join(logs, f"{engine}-{rate}.json")
        if not os.path.exists(path):
            continue
        r = json.load(open(path))
        cell = lambda m: f"{r[f'median_{m}_ms']:.1f} / {r[f'p99_{m}_ms']:.1f}"
        print(f"{engine:10} {rate:>5} {r['completed']:>5} {r['request_throughput']:6.2f} "
              f"{r['output_throughput']:9.0f} {cell('ttft'):>15} {cell('tpot'):>13} "
              f"{cell('itl'):>13}")
EOF
