#!/usr/bin/env bash
# Data-parallel GRPO step throughput on 1 GPU and on NPROC GPUs (default 2), then the table.
#
#   bash bench/run_ddp_bench.sh                       # results in $OUT (default bench/results/ddp)
#   STRONG=1 bash bench/run_ddp_bench.sh              # also the fixed-global-batch (strong) run
#   bash bench/run_ddp_bench.sh --new-tokens 256      # extra arguments go to bench/bench_ddp.py
#   bash bench/run_ddp_bench.sh --device cpu --model qwen2-tiny --lora-r 4 --prompt-len 16 --new-tokens 8   # CPU smoke
#
# Writes ddp_w1.json, ddp_w<N>.json, log_1gpu.txt, log_<N>gpu.txt, ddp_bench.md, ddp_bench.csv
# (and ddp_w<N>_strong.json with STRONG=1). NVLink multicast stays off in every process.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT="${OUT:-bench/results/ddp}"
NPROC="${NPROC:-2}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
status=0

echo "== 1 GPU (plain process) =="
CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" "$PY" -m bench.bench_ddp --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/log_1gpu.txt" || status=1

echo "== $NPROC GPUs (torchrun, DDP over the adapter) =="
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m bench.bench_ddp --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/log_${NPROC}gpu.txt" || status=1

if [ "${STRONG:-0}" = "1" ]; then
  echo "== $NPROC GPUs, same global batch as 1 GPU (strong scaling) =="
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m bench.bench_ddp --out "$OUT" --strong "$@" 2>&1 \
    | tail -n 40 || status=1
fi

"$PY" -m bench.bench_ddp --report "$OUT" || status=1
exit $status
