#!/usr/bin/env bash
# The GPU checks and figures in as few device calls as possible, for a session that is
# lent a GPU machine (it has Python 3.12, torch, triton, transformers, tokenizers,
# safetensors, uvloop, psutil, click, numpy, pytest; no internet). Each phase fits one
# 10-minute call; logs and JSON reports go to $OUT (or ./gpu-out).
#
# Here, once, fetch the packages that machine lacks (cp312 wheels) into .whl/ (ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     msgspec==0.22.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.3 \
#     pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions==4.16.0 \
#     jsonschema==4.26.0 jsonschema-specifications referencing rpds-py
# Then run with the device tool, carrying .whl. A session has ~30 device minutes, so
# in this order (the model step first, issue 13):
#   bash tools/gpu_session.sh latency   # batch-1 decode: graphs (sampling in the graph), fused
#                                       # ops off, eager, async; per-step breakdown and roofline
#   bash tools/gpu_session.sh tests     # GPU tests (graphs, in-graph sampling, fused ops,
#                                       # spec graphs, bf16 vs HF, sizing, sampler)
#   bash tools/gpu_session.sh kernels   # fused ops vs unfused, a decoder layer; MoE vs dense
#   bash tools/gpu_session.sh spec      # speculative decoding, graphs on vs off (oracle, n-gram, draft)
#   bash tools/gpu_session.sh guided    # JSON-schema guided vs plain at batch 1 and 32
#   bash tools/gpu_session.sh throughput  # nano-vllm workload vs HF generate
#   bash tools/gpu_session.sh serve     # the daemon under llmd bench serve at 4 and 16 req/s
#   bash tools/gpu_session.sh async     # async scheduling on vs off
set -uo pipefail
phase=${1:-tests}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site

# The project and the carried wheels into /tmp/site (the machine's torch stays).
if [ ! -d /tmp/site/llmd ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target /tmp/site . || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.txt"

MODEL=/tmp/tinyllama
if [ "$phase" != tests ] && [ ! -f $MODEL/model.safetensors ]; then
    python3 -m llmd_tools.make_model --arch llama --preset tinyllama --no-llama3-rope --out $MODEL || exit 1
fi
llmd() { python3 -m llmd.cli "$@"; }

case "$phase" in
tests)
    # Most of the suite is written for the CPU (fp32, exact equality with HF): on this
    # machine "auto" picks CUDA and bf16, so only these files run here.
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graphs.py tests/test_memory_sizing.py \
        tests/test_graph_sampling.py tests/test_spec_graphs.py tests/test_fused_ops.py tests/test_profile_step.py \
        2>&1 | tee "$OUT/tests.log"
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_moe.py tests/test_triton_attention.py \
        -k "cuda or triton" 2>&1 | tee -a "$OUT/tests.log"
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_sampler.py tests/test_engine_vs_hf.py \
        -k "cuda or bfloat16" 2>&1 | tee -a "$OUT/tests.log"
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_async_scheduling.py 2>&1 | tee -a "$OUT/tests.log"
    ;;
latency)
    # Graphs (default: forward, LM head and sampling captured, fused layer ops), the same
    # with fusion off (LLMD_FUSED_OPS=0), eager, and graphs with chained async steps in
    # a worker process; then the per-step breakdown (kernel vs wall time, kernels and
    # memcpys per step, roofline) at batch 1 and 32, fused and unfused.
    for mode in default "--enforce-eager" "--async-scheduling --distributed-executor-backend mp"; do
        name=$(echo "$mode" | tr -c 'a-z\n' '-' | cut -c1-40)
        llmd bench latency --model $MODEL --device cuda --dtype bfloat16 --batch-size 1 --input-len 32 \
            --output-len 256 --num-iters 5 --max-model-len 2048 ${mode#default} --json \
            | tee "$OUT/latency-$name.json"
    done
    LLMD_FUSED_OPS=0 llmd bench latency --model $MODEL --device cuda --dtype bfloat16 --batch-size 1 \
        --input-len 32 --output-len 256 --num-iters 5 --max-model-len 2048 --json | tee "$OUT/latency-unfused.json"
    for b in 1 32; do
        python3 -m llmd_tools.profile_step --model $MODEL --device cuda --dtype bfloat16 --batch $b --steps 50 \
            --json | tee "$OUT/profile-b$b.json"
        LLMD_FUSED_OPS=0 python3 -m llmd_tools.profile_step --model $MODEL --device cuda --dtype bfloat16 \
            --batch $b --steps 50 --json | tee "$OUT/profile-b$b-unfused.json"
    done
    ;;
kernels)
    python3 -m llmd_tools.bench_fused_ops --json | tee "$OUT/fused-ops.txt"
    python3 -m llmd_tools.bench_moe --device cuda --dtype bfloat16 --batch 1 16 --json | tee "$OUT/moe.txt"
    ;;
spec)
    python3 -m llmd_tools.bench_spec --model $MODEL --device cuda --dtype bfloat16 --graphs both \
        | tee "$OUT/spec.txt"
    ;;
guided)
    python3 -m llmd_tools.bench_guided --model $MODEL --dtype bfloat16 | tee "$OUT/guided.txt"
    ;;
serve)
    sock=/tmp/llmd-bench.sock
    python3 -m llmd.cli serve --model $MODEL --device cuda --dtype bfloat16 --max-model-len 2048 \
        --socket $sock >"$OUT/daemon.log" 2>&1 &
    daemon=$!
    for _ in $(seq 120); do
        python3 -m llmd_client.llmctl --socket $sock status >/dev/null 2>&1 && break
        sleep 1
    done
    llmd bench serve --socket $sock --input-len 256 --output-len 128 --num-prompts 200 \
        --request-rate 4,16 --json | tee "$OUT/serve.json"
    kill -TERM $daemon; wait $daemon
    ;;
throughput)
    llmd bench throughput --model $MODEL --device cuda --dtype bfloat16 --dataset nano --num-prompts 256 \
        --max-len 1024 --max-model-len 2048 --max-num-seqs 256 --hf-baseline --hf-batch-size 64 --json \
        | tee "$OUT/throughput.json"
    ;;
async)
    python3 -m llmd_tools.bench_async --model $MODEL --dtype bfloat16 --tokens 128 --repeats 2 \
        | tee "$OUT/async.txt"
    ;;
*)
    echo "unknown phase $phase (latency, tests, kernels, spec, guided, throughput, serve, async)" >&2
    exit 2
    ;;
esac
