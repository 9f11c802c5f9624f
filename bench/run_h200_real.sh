#!/usr/bin/env bash
# Issue #42 on one H200: the real 0.5B (GGUF) in 44 MiB pieces, then the accuracy table, the
# Trainer.evaluate() regression and the GRPO study, all in one hold (/tmp survives between calls
# only while the machine is held: it goes back 30 s after a call ends, so keep the calls coming).
# Here, first:
#   ../shared/tools/fetch-real-model qwen2.5-coder-0.5b-instruct     # ~/.cache/qerl-models/...gguf
#   mkdir -p .rm && (cd .rm && split -b 44M -d -a 2 --numeric-suffixes=1 ~/.cache/qerl-models/qwen2.5-coder-0.5b-instruct.gguf part \
#     && for f in part*; do mkdir p${f#part} && mv $f p${f#part}/part; done)   # 11 pieces; tracked files + one piece < 64 MiB
#   mkdir -p .rdata && cp ../shared/data/*.jsonl .rdata/                 # the data folder does not travel by itself
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform any -d .whl/real gguf humming-kernels==0.1.19 math-verify \
#     latex2sympy2_extended antlr4-python3-runtime==4.13.2
# (ignore .rm, .rdata and .whl in .git/info/exclude). Then, on the device, one call each:
#   bash bench/run_h200_real.sh piece 01          (carry .rm/p01) ... piece 10
#   bash bench/run_h200_real.sh setup 11          (carry .rm/p11 .rdata .whl): last piece, sha256, wheels, convert
#   bash bench/run_h200_real.sh eval [ARGS]       # bench.real_model eval (formats x tasks; ARGS e.g. --pass-k 8)
#   bash bench/run_h200_real.sh regress           # bench.real_model regress (train past 11 NVFP4 steps + evaluate)
#   bash bench/run_h200_real.sh grpo [ARGS]       # bench.real_grpo run (resumable: call again to continue)
set -uo pipefail
part="${1:?part}"; shift
OUT="${OUT:?set OUT}"
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
export PYTHONPATH="/tmp/site:$PWD" QERL_DATA=/tmp/data HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hc
case "$part" in
piece)
  n="${1:?piece number}"
  [ "$n" = 01 ] && rm -f /tmp/model.gguf
  cat ".rm/p$n/part" >> /tmp/model.gguf && ls -l /tmp/model.gguf ;;
setup)
  n="${1:?last piece number}"
  cat ".rm/p$n/part" >> /tmp/model.gguf
  echo "$SHA  /tmp/model.gguf" | sha256sum -c - || exit 1
  mkdir -p /tmp/data && cp .rdata/*.jsonl /tmp/data/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/real/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__, gguf.__version__ if hasattr(gguf, '__version__') else 'gguf')"
  python3 -m bench.real_model convert /tmp/model.gguf /tmp/m05 2>&1 | grep -v "it/s\]" ;;
eval)
  tag="${EVAL_TAG:-eval}"  # $OUT returns at most 8 files: the JSONs travel as one archive
  timeout "${LIMIT_S:-560}" python3 -m bench.real_model eval /tmp/m05 --out "/tmp/$tag" "$@" 2>&1 | grep -v "it/s\]"
  cp "/tmp/$tag/summary.md" "$OUT/$tag-summary.md"; tar czf "$OUT/$tag.tgz" -C /tmp "$tag" ;;
regress)
  timeout "${LIMIT_S:-560}" python3 -m bench.real_model regress /tmp/m05 --out /tmp/regress "$@" 2>&1 | grep -v "it/s\]"
  cp /tmp/regress/regress.json "$OUT/" ;;
grpo)
  mkdir -p /tmp/grpo
  timeout "${LIMIT_S:-540}" python3 -m bench.real_grpo run /tmp/m05 --out /tmp/grpo "$@" 2>&1 | grep -v "it/s\]"
  python3 -m bench.real_grpo report /tmp/grpo
  mkdir -p "$OUT/grpo" && cp /tmp/grpo/study.md /tmp/grpo/curves.json "$OUT/grpo/" 2>/dev/null
  (cd /tmp/grpo && tar czf "$OUT/grpo/runs.tgz" --exclude='checkpoint-*' */metrics.jsonl */final.json */log.txt 2>/dev/null) ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
