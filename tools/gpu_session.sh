#!/usr/bin/env bash
# The GPU checks and figures for a session that is lent a GPU machine (Python 3.12, torch,
# triton, transformers, tokenizers, safetensors, uvloop, psutil, click, numpy, pytest,
# pytest-timeout; no internet), in as few device calls as a 15-minute lease allows.
#
# Here, once, fetch the packages that machine lacks (cp312 wheels) into .whl/ (ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     msgspec==0.23.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions==4.16.0 \
#     jsonschema==4.26.0 jsonschema-specifications referencing rpds-py gguf==0.19.0
# Then, with the device tool, carrying .whl (timeout_s a little over the phases' sum):
#   bash tools/gpu_session.sh all        # every phase below in this order: > 10 minutes
#   bash tools/gpu_session.sh PHASE ...  # some of them: tests, pytests, latency, latency1,
#                                        # async, throughput, spec, guided, kernels, moe, quant, sweep,
#                                        # serve, hf
# What the steps took on an H200 (2026-11-30; the machine started and took the tree in
# ~30 s): pip ~10 s, make-model 41-43 s (in the background while the tests run), the
# tests' two groups side by side 86 s (kernels, 121 tests) and 130 s (graphs and packed
# models, 85), then tests-sizing 47 s; each profile_step 17-20 s, bench-quant 41 s, each
# throughput 26-30 s (40-44 s with graphs off), spec 28 s, guided 24 s, moe 43 s.
# Call 1 of that session, `LATENCY="b1 b32" ROUNDS=1 bash tools/gpu_session.sh tests
# latency quant throughput guided spec moe`, took 423 s; the confirming call (tests again,
# latency, spec, guided, throughput) 333 s: together 14 of the 15 minutes.
# The third lease (2026-11-30, later): `TESTS_LIMIT=240 LATENCY="b1 b32" bash
# tools/gpu_session.sh tests quant moe latency` took 446 s (tests-graphs 188 s now, with
# the packed MoE models; tests-kernels 109 s; bench-quant 39 s, bench-quant-moe 25 s), a
# confirming `pytests quant` 142 s; the machine's start ~35 s each.
# A plan for the next lease (each call ~35 s more to start and copy):
#   call 1 (~540 s): LATENCY="b1 b32 b256 b32-guided" bash tools/gpu_session.sh sweep quant latency moe async
#   call 2 (~300 s): TESTS_LIMIT=240 ROUNDS=1 bash tools/gpu_session.sh tests serve throughput spec guided
# with PYTEST_ARGS naming only what failed when a rerun must join call 2. New since the
# third lease, first run on a GPU in that plan: the MoE work list's one Triton launch
# (tests: test_moe.py's one_launch cases compiled; quant: bench_quant_moe_gpu's align
# columns, one launch vs torch ops at 8-512 pairs: set moe_align.TRITON_MAX_PAIRS from
# them), the GEMV's stalls by PC sampling (quant: gemv-stalls, its hatchet files in
# $OUT: read them here, then restructure the K loop against what stalls), the high bits
# loaded a tile at a time (bench-quant's Q3_K / Q5_K / Q5_0 rows against the last lease's),
# Q4_K / Q5_K's scale words (sweep: the "scale words" rows; make them the default where
# they win), and TP shares of whole blocks (CPU-only tests; no GPU TP check here). New
# since 2026-12-01: GPTQ act-order MLPs and experts in their down projection's group order
# (tests: test_quant_cuda_models' gptq4-asym-v2-act-order and gptq4-act-order MoE cases;
# the grouped kernel then takes down's part with no order, cuda_matmul._as_they_come).
#
# Each step runs under its own time limit (`step NAME SECONDS CMD`), so one that hangs or
# runs long costs its limit and the later ones still run. Every step's output goes to
# $LOGS/NAME.log and the list of steps with their exit status and seconds to steps.txt;
# after each step all of it is packed into $OUT/logs.tgz (the device tool brings back at
# most 8 files), and the end prints a short summary (the tool returns the output's tail).
# LLMD_GPU_QUICK=1 shrinks every workload (a check of the script itself, e.g. on CPU with
# DEVICE=cpu; figures from it mean nothing).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
LOGS=${LOGS:-/tmp/gpu-logs}
DEVICE=${DEVICE:-cuda}
QUICK=${LLMD_GPU_QUICK:-0}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

pack() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }

step() {  # step NAME SECONDS CMD...: CMD under its own time limit, output to $LOGS/NAME.log
    local name=$1 secs=$2 t0=$SECONDS rc
    shift 2
    echo "== $name (limit ${secs}s): $*" >"$LOGS/$name.log"
    timeout -k 10 "$secs" "$@" >>"$LOGS/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$LOGS/steps.txt"
    pack
    return 0
}

setup() {
    # The project and the carried wheels into /tmp/site (the machine's torch stays).
    if [ "$DEVICE" = cuda ] && [ ! -d /tmp/site/llmd ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
            --target /tmp/site . || exit 1
    fi
    [ "$DEVICE" = cuda ] && export PYTHONPATH=/tmp/site
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,utilization.gpu \
          --format=csv,noheader 2>/dev/null
      $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
      nproc; uptime; } | tee -a "$LOGS/device.txt"
}

MODEL=${MODEL:-/tmp/tinyllama}
MAKE_PID=
need_model() {  # the TinyLlama-shaped fixture the figures are taken on (~30 s to build there)
    if [ -n "$MAKE_PID" ]; then wait "$MAKE_PID"; MAKE_PID=; fi
    if [ ! -f "$MODEL/model.safetensors" ]; then
        preset=tinyllama
        [ "$QUICK" = 1 ] && preset=small
        step make-model 120 $PY -m llmd_tools.make_model --arch llama --preset $preset --no-llama3-rope --out "$MODEL"
    fi
}

tests() {
    # Most of the suite is written for the CPU (fp32, exact equality with HF); on this
    # machine "auto" picks CUDA and bf16, so these run here: the files about graphs,
    # packed weights on CUDA and profiling whole, and of the rest the CUDA cases (the
    # Triton kernels compiled, the sampler on CUDA, bf16 vs HF on CUDA, sleep on CUDA).
    # The two groups run side by side, each over TEST_WORKERS processes a file each
    # (a kernel file compiles all its cases once per process that runs any of them);
    # then, alone on the device, the files that read its free memory.
    # TESTS_GRAPHS, TESTS_KERNELS (run with -k cuda) and TESTS_SIZING name other files or
    # node ids for a rerun ("-" for none).
    local pt=($PY -m pytest -q -rfEs -p no:cacheprovider --timeout 120)
    local par=(-n "${TEST_WORKERS:-5}" --dist loadfile) pids=()
    local graphs=${TESTS_GRAPHS:-tests/test_cuda_graphs.py tests/test_graph_sampling.py tests/test_spec_graphs.py
        tests/test_flash_attention.py tests/test_quant_cuda_models.py}
    local kernels=${TESTS_KERNELS:-tests/test_fused_ops.py tests/test_triton_attention.py tests/test_moe.py
        tests/test_triton_quant.py tests/test_triton_quant_moe.py tests/test_sampler.py tests/test_engine_vs_hf.py
        tests/test_sleep_mode.py}
    local sizing=${TESTS_SIZING:-tests/test_memory_sizing.py tests/test_profile_step.py}
    # shellcheck disable=SC2086
    if [ "$graphs" != - ]; then
        OMP_NUM_THREADS=2 step tests-graphs "${TESTS_LIMIT:-170}" "${pt[@]}" "${par[@]}" \
            --junitxml="$LOGS/tests-graphs.xml" $graphs &
        pids+=($!)
    fi
    # shellcheck disable=SC2086
    if [ "$kernels" != - ]; then
        OMP_NUM_THREADS=2 step tests-kernels "${TESTS_LIMIT:-170}" "${pt[@]}" "${par[@]}" \
            --junitxml="$LOGS/tests-kernels.xml" $kernels -k cuda &
        pids+=($!)
    fi
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
    # shellcheck disable=SC2086
    [ "$sizing" != - ] && step tests-sizing 90 "${pt[@]}" --junitxml="$LOGS/tests-sizing.xml" $sizing
    return 0
}

pytests() {
    # The tests named in $PYTEST_ARGS (files or node ids): a rerun of what failed or was
    # cut short, e.g. PYTEST_ARGS="tests/test_graph_sampling.py tests/test_sampler.py::test_x".
    local pt=($PY -m pytest -q -rfEs -p no:cacheprovider --timeout 90)
    # shellcheck disable=SC2086
    step tests-rerun-${RERUN:-1} "${PYTEST_LIMIT:-150}" "${pt[@]}" $PYTEST_ARGS
}

latency() {
    need_model
    # Batch-1 decode: graphs with fused ops (the default), fused ops off, sampling after
    # the graph, eager; then batch 32, and batch 256 over 512-token contexts (the nano
    # workload's steps: 8.3 ms on average on the H200, where b32 took 1.9; host work at
    # 256 rows, ~3 ms a step on a 2-core CPU, or the device?). Each: wall vs kernel time
    # per step, kernels per step, roofline. LATENCY names a subset (e.g. "b1 b32").
    local steps=40 v
    [ "$QUICK" = 1 ] && steps=4
    local ps=($PY -m llmd_tools.profile_step --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --steps $steps)
    for v in ${LATENCY:-b1 b1-unfused b1-eager-sampling b1-eager b32 b256 b32-guided}; do
        case $v in
        b1) step profile-b1 40 "${ps[@]}" --batch 1 ;;
        b1-unfused) LLMD_FUSED_OPS=0 step profile-b1-unfused 40 "${ps[@]}" --batch 1 ;;
        b1-eager-sampling) LLMD_GRAPH_SAMPLING=0 step profile-b1-eager-sampling 40 "${ps[@]}" --batch 1 ;;
        b1-eager) step profile-b1-eager 40 "${ps[@]}" --batch 1 --enforce-eager ;;
        b32) step profile-b32 40 "${ps[@]}" --batch 32 ;;
        b256) step profile-b256 60 "${ps[@]}" --batch 256 --input-len 512 ;;
        b32-guided) step profile-b32-guided 40 "${ps[@]}" --batch 32 --guided ;;  # guided cost 35%: where
        *) echo "unknown LATENCY variant $v" >&2 ;;
        esac
    done
}

latency1() {  # batch-1 decode with the defaults alone
    need_model
    local ps=($PY -m llmd_tools.profile_step --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --steps 40)
    step profile-b1 40 "${ps[@]}" --batch 1
}

throughput() {
    need_model
    # The nano-vllm workload (256 requests, lengths uniform in [100, 1024]), llmd only,
    # in-graph sampling on and off (LLMD_GRAPH_SAMPLING), alternated over two rounds:
    # one run each gave 17,240 (tails off) and 12,866 out tok/s (on) on an H100.
    local n=256 round
    [ "$QUICK" = 1 ] && n=8
    local tp=($PY -m llmd.cli bench throughput --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --dataset nano
              --num-prompts $n --max-len 1024 --max-model-len 2048 --max-num-seqs 256)
    for round in $(seq "${ROUNDS:-2}"); do
        step throughput-$round 60 "${tp[@]}"
        [ "${THROUGHPUT_AB:-1}" = 1 ] && LLMD_GRAPH_SAMPLING=0 step throughput-eager-sampling-$round 60 "${tp[@]}"
    done
}

hf() {
    need_model
    # The same workload through HF generate (llmd's figures are printed first, on stderr).
    local n=256
    [ "$QUICK" = 1 ] && n=8
    step throughput-hf 120 $PY -m llmd.cli bench throughput --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --dataset nano \
        --num-prompts $n --max-len 1024 --max-model-len 2048 --max-num-seqs 256 --hf-baseline --hf-batch-size $n
}

spec() {
    need_model
    # n-gram on prompts it never matches (its pure cost), oracle drafts 75% right, a
    # tiny draft model; graphs on.
    local tokens=96
    [ "$QUICK" = 1 ] && tokens=8
    step spec 60 $PY -m llmd_tools.bench_spec --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --graphs on \
        --oracle-every 4 --tokens $tokens --batches 1,16
}

guided() {
    need_model
    local tokens=64 rounds=3
    [ "$QUICK" = 1 ] && tokens=4 rounds=1
    step guided 40 $PY -m llmd_tools.bench_guided --model "$MODEL" --dtype bfloat16 --tokens $tokens --rounds $rounds
}

kernels() {
    [ "$DEVICE" = cuda ] && step fused-ops 30 $PY -m llmd_tools.bench_fused_ops --rounds 3
    moe
}

moe() {
    step moe 45 $PY -m llmd_tools.bench_moe --device "$DEVICE" --dtype bfloat16 --batch 1 16
}

quant() {
    # Packed weights on CUDA (issue 27; their tests are in the tests phase): W4A16 / FP8
    # decode matmuls as a fraction of the packed bytes' roofline beside bf16 dense.
    step bench-quant 100 $PY -m llmd_tools.bench_quant_gpu --types Q4_0 Q5_0 Q3_K Q4_K Q5_K Q6_K Q8_0 IQ4_NL FP8 --rows 1 16 \
        --shapes 4096x4096 14336x4096
    # A MoE layer's packed experts (Qwen3-30B-A3B's shapes, Q4_K_M and Q8_0) through the
    # grouped kernel against the touched experts' bytes, beside the bf16 fused-MoE kernel.
    step bench-quant-moe 60 $PY -m llmd_tools.bench_quant_moe_gpu --tokens 1 4 16 32 64
    # Why the GEMV stalls (21-26 % of its roofline where its instructions allow ~64 %): the
    # GPU's PC sampling by source line (proton); the raw tree comes back in $OUT.
    step gemv-stalls 60 $PY -m llmd_tools.profile_quant_gemv --types Q4_K Q4_0 --calls 300 --out "$OUT"
    # The same defaults as the device's own Triton compiles them (registers, K loop
    # instructions, the offline estimate), beside the times above: does the model that
    # chose the tiles (on this machine's Triton 3.9) hold for the device's compiler?
    step quant-resources 60 $PY -m llmd_tools.quant_kernel_resources --types Q4_0 Q2_K Q3_K Q4_K Q6_K Q8_0 IQ4_NL FP8 \
        --rows 1 16
}

async() {
    need_model
    # Async scheduling (off by default until measured on a GPU): the same greedy requests
    # with it off and on, in process and in a worker process, batch 1 and 32 — what of
    # the batch-1 step's host gap (0.33 ms of 1.42 on the H200) it hides.
    local tokens=128
    [ "$QUICK" = 1 ] && tokens=8
    step async 120 $PY -m llmd_tools.bench_async --model "$MODEL" --dtype bfloat16 --tokens $tokens --repeats 2
}

sweep() {
    # The packed matmul's tile, stages and split-K over a grid (issue 27: the defaults were
    # never tuned on a GPU, and the pipelined tiles are chosen offline); the fastest points
    # beside the default's. Each tile compiles once per kind of split: the sweep stops
    # starting tiles at its budget, within the step's limit.
    step quant-sweep 180 $PY -m llmd_tools.bench_quant_sweep --types Q4_K Q8_0 --rows 1 16 --shapes 14336x4096 \
        --budget-s 150
}

serve() {
    need_model
    local sock=/tmp/llmd-bench.sock n=48
    [ "$QUICK" = 1 ] && n=4
    setsid $PY -m llmd.cli serve --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --max-model-len 2048 \
        --socket $sock >"$LOGS/daemon.log" 2>&1 &
    local daemon=$!
    for _ in $(seq 90); do
        $PY -m llmd_client.llmctl --socket $sock status >/dev/null 2>&1 && break
        sleep 1
    done
    step serve 50 $PY -m llmd.cli bench serve --socket $sock --input-len 256 --output-len 128 --num-prompts $n \
        --request-rate 4,16
    kill -TERM -- -$daemon 2>/dev/null
    timeout 30 tail --pid=$daemon -f /dev/null
    kill -KILL -- -$daemon 2>/dev/null
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(all)
[ "${phases[0]}" = all ] && phases=(tests latency async quant sweep throughput guided spec kernels serve hf)
for phase in "${phases[@]}"; do
    case "$phase" in
    tests | pytests | latency | latency1 | async | throughput | spec | guided | kernels | moe | quant | sweep | serve | hf)
        ;;
    *) echo "unknown phase $phase (all, tests, pytests, latency, latency1, async, throughput, spec, guided," \
            "kernels, moe, quant, sweep, serve, hf)" >&2; exit 2 ;;
    esac
done
setup
for phase in "${phases[@]}"; do  # the fixture built while the tests run, when a later phase needs it
    case "$phase" in latency | latency1 | async | throughput | spec | guided | serve | hf) need_model & MAKE_PID=$!; break ;; esac
done
for phase in "${phases[@]}"; do
    "$phase"
done

# The summary: the steps, the tests' outcome lines and failures, each figure's key lines.
echo "===== summary"
cat "$LOGS/steps.txt"
for f in "$LOGS"/tests-*.log; do
    [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E "^(FAILED|ERROR)|passed|failed|Timeout|^E  " "$f" | cut -c1-300 | tail -25; }
done
for f in "$LOGS"/profile-*.log; do
    [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E -A8 "^profile_step:" "$f" | cut -c1-220; tail -2 "$f"; }
done
for name in throughput-1 throughput-eager-sampling-1 throughput-2 throughput-eager-sampling-2 throughput-hf spec \
        guided async fused-ops moe bench-quant quant-resources quant-sweep serve; do
    f="$LOGS/$name.log"
    [ -f "$f" ] && { echo "--- $name"; grep -v "^{" "$f" | grep -v -E "it/s\]|%\|" | tail -14 | cut -c1-220; }
done
pack
