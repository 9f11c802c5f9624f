#!/usr/bin/env bash
# The one device script: plumbing for a run on a lent GPU machine (environment, carried wheels,
# the real model carried in pieces, the Countdown model, bitsandbytes) and one command per benchmark.
# Every command writes under $OUT and prints a short tail; /tmp survives between calls only while the
# machine is held, so commands that build on each other run in one hold.
#
#   OUT=... bash bench/device.sh COMMAND [ARGS]
#
# Our engine and the baselines (Qwen2.5 shapes, random weights; results: bench/results/engine_h200.md,
#  live_rows_h200.md, same_day_h200.md):
#   engine7b                  compiled engine-kernel tests (ENGINE_TESTS=0 skips them), then 7B fixed lengths
#                             (BATCHES, default "1 8 64 256"; groups of 8)
#   engine32b ["VARIANTS"]    32B fixed lengths; VARIANTS default "engine-bf16 engine-nvfp4"
#   live7b                    7B realistic lengths (live-row compaction)
#   vllm FMT [ARGS]           vLLM 0.26 (FMT nvfp4|bf16|nf4) after the vLLM pieces' install.sh
#                             (bash bench/vllm_carry.sh cuts them and prints each call's carry);
#                             ARGS go to bench.bench_vllm_lengths; nf4 needs .vllm/uns/slim.tgz or .vllm/bnb/*.whl
#   grpo-engines FMT          one whole GRPO step on StaticEngine and on vLLM (FMT nvfp4|bf16)
#   memory [ARGS]             peak memory of GRPO steps against the memory plan (bench.bench_memory; ARGS e.g.
#                             --models 0.5B 7B, or --models 32B --formats nvfp4); the rows are appended to a copy
#                             of tests/data/measured_peaks.json in $OUT (copy it back over the committed one);
#                             one process per case, MEM_BUDGET (default 420 s) stops new cases; logs in memory/logs.tgz
#   gpu-tests [FILES]         the GPU-only tests of what was written without a GPU (#45: dense cache, fold, NF4/MXFP4
#                             kernels, engine groups, memory plan and engine memory, step bench); FILES replace the
#                             default list (tests/test_bench_trl_step.py, a call of its own: carry .vllm/uns)
#                             (pytest travels as wheels: python3 -m pip download -d .whl/test pytest; carry .whl)
#   profile-update [MODEL] ["FORMATS"]  one update pass (forward + backward, checkpointing on, 2 micro-batches of 8 x
#                             256 + 512 tokens, LoRA r32) per format: packed, dense cache (held path), cache through the
#                             routed Function, then profiled (bench.bench_dense_cache --profile); MODEL Qwen2.5-7B, FORMATS
#                             "nvfp4 none" (none first: the "vs bf16" column); UPDATE_ARGS replaces the shape flags (e.g.
#                             "--micro-batch 8 --micro-batches 8 --prompt 256 --completion 512 --repeats 3", + --stacks,
#                             --paired: the formats alternated); profile.md, profile_<fmt>.txt in $OUT/profile-update
#   fair                      NF4 and MXFP4 on their routed kernels (lut4_triton) against bf16 and NVFP4 per 7B layer
#                             (bench.bench_lut4, the GEMV and the dense path each forced; bitsandbytes' matmul_4bit where
#                             .vllm/uns/slim.tgz or .vllm/bnb carries it), then our engine decoding the 7B in each
#                             format (bench.bench_rollout engine-nvfp4 engine-nf4 engine-mxfp4, and transformers +
#                             bitsandbytes' hf-nf4 with it; BATCHES default "1 8 64"): the issue's fair-baseline
#                             check; $OUT/fair/lut4, $OUT/fair/engine, the logs in logs.tgz
#   lut4-sweep                lut4_gemv's MMA-path configs (BLOCK_K, stages) against the dense path per 7B
#                             layer at 8 and 64 rows (bench.bench_lut4_sweep); $OUT/lut4-sweep/sweep.{md,csv}
#   pyspy-update [MODEL] ["A B"]  profile-update's dense-cache pass (--modes dense), one process per format under py-spy
#                             (native frames, PYSPY_RATE/s (50), PYSPY_THREADS (1) torch threads, PYSPY_TIMEOUT 240; the
#                             wheel in .whl/prof: pip download --no-deps --only-binary=:all: -d .whl/prof py-spy), then
#                             bench.pyspy_diff: the frames whose sampled seconds differ most between A and B ("none
#                             nvfp4"); UPDATE_ARGS as above; $OUT/pyspy/diff.md, tables, logs, raw samples in raw.tgz
#   engine-ab [MODEL] ["FORMATS"]  the update pass (--modes dense) per format alone, after our engine generated ENGINE_NEW
#                             (512) tokens per prompt and kept, and after it was dropped (AB_RUNS "alone after-engine after-
#                             freed"; "frozen": the GC's heap frozen), one process each; MODEL Qwen2.5-1.5B,
#                             FORMATS "none nvfp4", UPDATE_ARGS as for profile-update; $OUT/engine-ab/<fmt>-<run>.md
#   trim [MODEL] ["FORMATS"]  one update pass at the real 1.5B's GSM8K lengths (16 x 8 rows, checkpointing on): micro-
#                             batches padded to the batch, trimmed to their own width, sorted by length first,
#                             packed to the padded micro-batch's tokens (bench.bench_trim); MODEL default Qwen2.5-7B,
#                             FORMATS "none nvfp4", TRIM_MODES (default "padded trimmed sorted packed", the first the
#                             reference, e.g. "sorted packed"); $OUT/trim/trim.md
#   routes ["MODELS"] ["MS"]  per-layer NVFP4 forward, routed vs humming vs ours vs bf16 in CUDA graphs
#                             (bench.bench_routes) for the small models' shapes the table was never measured at;
#                             MODELS default "Qwen2.5-0.5B Qwen2.5-1.5B", MS (rows) default "1 8 64"; $OUT/routes
#   hc-save                   humming's compiled kernels of this hold as $OUT/hc/hc.tgz.part_*; copied to .whl/hc/ here and
#                             carried with .whl, a later hold starts with them (a 7B shape compiles in ~20 s)
#   lora-tiling [MODEL] [TILING]  the grouped-LoRA tests compiled (TILING_TESTS=0 skips them; pytest from .whl/test),
#                             then the decode step's grouped LoRA under each lora_triton.Tiling at MODEL's (default
#                             Qwen2.5-7B) group shapes, 8 / 64 / 128 rows (bench.bench_lora_tiling, $OUT/lora-tiling); with
#                             TILING (SPLITS,BLOCK_M,N_BLOCKS[,reduce], or auto: the sweep's fastest, its best.txt) also the
#                             engine's decode step with it against the default, batches 8 and 64, 256 new tokens
#                             (bench.bench_lora_engine --tiling); TILING_GRID=small sweeps 21 tilings, not 57
#   census [MODELS]           where a step's memory sits when its rollout ends, named tensor by tensor against the
#                             plan's parts (bench.probe_memory_census; MODELS default "Qwen2.5-32B Qwen2.5-7B", NVFP4);
#                             $OUT/census-<model>/census.md; CENSUS_ARGS adds flags (--history: each live block's
#                             allocating line, --dense-decode off)
#   repro-tests               tests/test_tuning.py compiled: each kernel's bits in two processes (humming: non-strict xfail)
#   repro [ARGS]              bench.bench_repro (3 processes, one fixed-seed rollout + Trainer step each, sha256s
#                             compared) on the tiny model and, after model-setup, the real GGUF (REPRO_NEW tokens, 384:
#                             at 128 no reward, no update); ARGS go to both runs (e.g. --backend ours
#                             --torch-deterministic); each repro.md loose, logs, repro.json, autotune.json in repro_logs.tgz
#   nb05                      notebook 05 on the GPU with vLLM; the Jupyter wheels from
#                             bench/make_notebook_carry.sh (.whl/nb, a call of its own)
#   unsloth                   Unsloth's GRPO rollout path (bench/probe_unsloth.py); carry .vllm/uns
#                             (bench/make_unsloth_carry.sh)
# The whole GRPO step per phase (bench.bench_step; 8 prompts x group 8, prompt 256, LoRA r32, the last of
# two steps, or STEP_STEPS=4: the median of the three after the warm-up, with their range; each (format, engine) in its own process; writes $OUT/<command-args>/step.{csv,md,png} and logs.tgz
# (rows.jsonl and every log: a call returns at most 8 files); merge
# several calls' tables with `python -m bench.bench_step report DIR... --out MERGED`; STEP_ARGS adds flags to any
# of them, e.g. STEP_ARGS="--max-rows 32 --keep-cache off": decoding in turns with the cache freed, or
# STEP_ARGS=--profile: one more step per run under torch.profiler, its report in logs.tgz ("--profile stacks":
# the synchronizations' Python call sites too, about twice the profiler's cost):
#   step7b ["FORMATS"] ["CKPT"]   7B, 512 tokens, StaticEngine; FORMATS default "none nvfp4" (also nf4 mxfp4, and
#                             bnb-nf4: bitsandbytes' NF4, needs .vllm/uns/slim.tgz or .vllm/bnb/*.whl),
#                             CKPT (gradient checkpointing) default "off on"
#   step-model MODEL ["FORMATS"] ["CKPT"]  another preset (Qwen2.5-0.5B, -1.5B, -14B, -32B), 512 tokens, StaticEngine;
#                             CKPT default "on" (14B and 32B need it; give "off on" for the small ones); 32B and
#                             72B run the Trainer's own dense-cache budget (--dense-cache auto), the others all of it
#   step-paper ["FORMATS"] [MU] [LENGTHS]  7B, the paper's GSM8K preset: 16 x 8 rows, LENGTHS "paper" (lognormal
#                             mean 300, cap 4096; the default), "paper-tail" (4% of rows to 4096: a stress case) or
#                             "measured:real05b" (the real 0.5B's own lengths at cap 4096), checkpointing on,
#                             micro-batch 8, mu default 1 (the preset's is 4)
#   step-vllm FMT             7B, 512 tokens, the same step on StaticEngine and on vLLM 0.26 (FMT none|nvfp4|nf4;
#                             vLLM installed as for `vllm`)
#   layout-ab STEPCMD [ARGS]  STEPCMD (any command above) twice, with STEP_ARGS + --layout aligned, then padded (the
#                             training forward's layouts, same machine); each table folder packed into <tag>.tgz
#   step05b-real ["FORMATS"] ["LENGTHS"]  the real 0.5B converted by model-setup (/tmp/m05; REAL_MODEL=1.5b: /tmp/m15), GSM8K prompts,
#                             16 x 8, mu 4, LoRA r16; FORMATS default "none nvfp4" (then "nf4 mxfp4"),
#                             LENGTHS default "fixed:512 natural:512" (natural: its own completions); ENGINES="static vllm"
#                             adds vLLM 0.26 on the same prompts and lengths (after the vLLM pieces' install)
# The field's whole GRPO step at the same shapes (bench.bench_trl_step: TRL's GRPOTrainer and Unsloth's GRPO path;
# each stack in its own process; 8 prompts x group 8, prompt 256, 512 new tokens, micro-batch 8, LoRA r32, mu 1,
# gradient checkpointing on, 3 steps, the first a warm-up; writes $OUT/<command-args>/step.md and logs.tgz):
#   step-trl ["STACKS"] [MODEL] [ARGS]  STACKS default "trl-nf4 trl-bf16 unsloth" (trl-nf4: bitsandbytes NF4 QLoRA,
#                             trl-bf16: bf16 + LoRA, both on transformers' generate; unsloth: FastLanguageModel 4-bit
#                             + its vLLM engine); MODEL default Qwen2.5-7B (random weights; the checkpoint stays in
#                             /dev/shm/trl-ckpt for the hold, later calls reuse it: one stack per call fits the
#                             time) or a model directory (the real 0.5B that model-setup converts); ARGS go to
#                             bench.bench_trl_step (e.g. --trl-vllm colocate, --steps 2). Carry .vllm/uns
#                             (bench/make_unsloth_carry.sh: unsloth, trl, datasets, bitsandbytes); unsloth also
#                             needs vLLM (the vLLM pieces' install.sh in this hold). Compare with
#                             `step7b "none nvfp4 bnb-nf4" on` (the same shapes on our Trainer)
# The Countdown model and grid (docs/experiments.md):
#   countdown                 three calibrations side by side, the best kept (bench.countdown_pick)
#   cdtrain                   the shipped calibration alone, its shards' sha256 checked against the committed ones
#   cdgrid [MODEL] [LIMIT_S] [STEPS] [LR]   the grid (resumable: call again, or carry .vllm/cdgrid/parts.tgz);
#                             LR "best" takes cdsweep's choice; CD_CONFIGS / SEED_GROUPS pick configs and seeds
#   cdsweep [LIMIT_S] [STEPS] ["LRS"]       bf16 and NVFP4 at the same lr, seeds 0 1; picks the lr
# The real 0.5B (GGUF) in pieces of 42.5 MB, 12 (a call carries 64 MiB with the tracked files, which take
# 23 MB on disk in 2026-12: `git ls-files -z | xargs -0 du -cB1 | tail -1`; 44 MiB pieces no longer fit): prepare here
#   ../shared/tools/fetch-real-model qwen2.5-coder-0.5b-instruct
#   mkdir -p .rm && (cd .rm && split -b 42500000 -d -a 2 --numeric-suffixes=1 ~/.cache/qerl-models/qwen2.5-coder-0.5b-instruct.gguf part \
#     && for f in part*; do mkdir p${f#part} && mv $f p${f#part}/part; done)
#   mkdir -p .rdata && cp ../shared/data/gsm8k_*.jsonl .rdata/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform any -d .whl/real gguf humming-kernels==0.1.19 math-verify \
#     latex2sympy2_extended antlr4-python3-runtime==4.13.2
# (.rm, .rdata and .whl ignored in .git/info/exclude), then one call each:
#   (the 1.5B: REAL_MODEL=1.5b on every call below and on step05b-real / repro, qwen2.5-coder-1.5b-instruct
#   (cut into .rm15, carry .rm15/pNN): 27 pieces of 42.5 MB, converted to /tmp/m15; results tagged step15b-real)
#   model-piece NN            (carry .rm/pNN) for 01 ... 11 (a few seconds each)
#   model-setup NN            (carry .rm/pNN .rdata .whl/real; .rdata: gsm8k_train and gsm8k_test only) the last piece, sha256 (then /tmp/model.sha256.ok, which
#                             repro and step05b-real test), data, convert
#   real-eval [ARGS]          bench.real_model eval (EVAL_TAG names the output; ARGS e.g. --pass-k 8)
#   real-regress [ARGS]       bench.real_model regress
#   real-grpo [ARGS]          bench.real_grpo run, resumable: call again to continue
#   engine-policy [ARGS]      bench.probe_engine_policy: StaticEngine's log-probs of its own samples against a teacher-
#                             forced forward, per engine feature switched off; $OUT/policy/policy.{md,json} (--trainer --batch
#                             FILE: the step on a saved rollout, e.g. engine_policy_h100/hold10/batch-none.pt.gz; --layout padded)
set -uo pipefail
cmd="${1:?command}"; shift
OUT="${OUT:?set OUT}"
# REAL_MODEL=0.5b (default) or 1.5b: which real GGUF the model-* commands join and check, and the real-* /
# step05b-real / repro commands read (converted to /tmp/m05 or /tmp/m15; the marker holds the checked sha256)
case "${REAL_MODEL:-0.5b}" in
0.5b) MODEL_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32; MODEL_DIR=/tmp/m05 ;;
1.5b) MODEL_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046; MODEL_DIR=/tmp/m15 ;;
*) echo "REAL_MODEL must be 0.5b or 1.5b; got ${REAL_MODEL}" >&2; exit 2 ;;
esac
# the model's pieces here: .rm/pNN (the 0.5B), .rm15/pNN (the 1.5B), so both can wait in one checkout
PIECES=.rm; [ "${REAL_MODEL:-0.5b}" = 1.5b ] && PIECES=.rm15
model_checked() {  # model-setup wrote the marker after this model's sha256 matched (not the other model's)
  [ -f /tmp/model.sha256.ok ] && [ "$(cat /tmp/model.sha256.ok)" = "$MODEL_SHA" ]
}

# -- plumbing -------------------------------------------------------------------------------------
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hc \
  QERL_DATA=/tmp/data

carried_wheels() {  # the pinned wheels this repository carries (humming-kernels, gguf, math-verify, ...)
  local wheels=()
  for d in .whl/h19 .whl/common .whl/real .whl/test .whl/prof; do [ -d "$d" ] && wheels+=("$d"/*.whl); done
  [ ${#wheels[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" 2>/dev/null
  # humming keys its compiled kernels (HUMMING_CACHE_DIR) on its headers' paths and mtimes; every call reinstalls
  # the wheel, which would give them new mtimes and recompile each shape (~20 s a 7B shape) in every call.
  # A fixed mtime makes the key the wheel's own, so later calls of a hold, and a carried cache, hit.
  [ ! -d /tmp/site/humming/include ] || find /tmp/site/humming/include -name '*.cuh' -exec touch -d @1767225600 {} +
}

humming_cache() {  # humming's compiled kernels from an earlier hold (hc-save), once per hold: sm_90, this wheel
  ls .whl/hc/hc.tgz.part_* > /dev/null 2>&1 && [ ! -f /tmp/hc/.carried ] || return 0
  mkdir -p /tmp/hc && cat .whl/hc/hc.tgz.part_* | tar -xz -C /tmp/hc && touch /tmp/hc/.carried \
    && echo "humming cache: $(find /tmp/hc -name kernel.cubin | wc -l) kernels from .whl/hc"
}

bitsandbytes() {  # an unpacked install folder that holds bitsandbytes, else its carried wheel
  if [ -f .vllm/uns/slim.tgz ]; then
    tar -xzf .vllm/uns/slim.tgz -C /tmp && export PYTHONPATH="/tmp/slim:$PYTHONPATH"
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .vllm/bnb/*.whl \
      && export PYTHONPATH="/tmp/bnb:$PYTHONPATH"
  fi
}

cd_model() {  # the Countdown model: this hold's countdown/cdtrain, else the one carried in .vllm/cd
  if [ -f /tmp/cd/chosen_path ]; then cat /tmp/cd/chosen_path; return; fi
  if ls .vllm/cd/model.tar.part_* > /dev/null 2>&1; then
    mkdir -p /tmp/cd && cat .vllm/cd/model.tar.part_* | tar -x -C /tmp/cd && d=$(ls -d /tmp/cd/m* | head -1) \
      && echo "$d" > /tmp/cd/chosen_path && echo "$d"
  fi
}

carried_wheels
humming_cache
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader

# -- benchmarks -----------------------------------------------------------------------------------
case "$cmd" in
engine7b)
  if [ "${ENGINE_TESTS:-1}" != 0 ]; then  # the fused kernels compiled (CPU CI runs them in Triton's interpreter)
    timeout 150 python3 -m pytest tests/test_engine_fused.py -q -x -p no:cacheprovider \
      > "$OUT/gpu_tests_log.txt" 2>&1; echo "engine-kernel tests rc=$?"; tail -3 "$OUT/gpu_tests_log.txt"
  fi
  read -r -a batches <<< "${BATCHES:-1 8 64 256}"
  timeout 360 python3 -m bench.bench_rollout --parts rollout --models Qwen2.5-7B --nvfp4-only \
    --variants engine-bf16 engine-nvfp4 --batches "${batches[@]}" --n 8 --budget 300 --out "$OUT/r7" > /tmp/r7_log.txt 2>&1
  cp /tmp/r7_log.txt "$OUT/r7/stdout_log.txt"
  grep -v Warning /tmp/r7_log.txt | grep -E "ms/step|failed|Error" | tail -20 ;;
engine32b)
  read -r -a variants <<< "${1:-engine-bf16 engine-nvfp4}"
  timeout 330 python3 -m bench.bench_rollout --parts rollout --models Qwen2.5-32B --nvfp4-only --variants "${variants[@]}" \
    --batches 1 8 64 256 --n 8 --budget 230 --out "$OUT/r32" > /tmp/r32_log.txt 2>&1
  cp /tmp/r32_log.txt "$OUT/r32/stdout_log.txt"
  grep -v Warning /tmp/r32_log.txt | tail -14 ;;
live7b)
  python3 -m bench.bench_live_rows --models Qwen2.5-7B --formats nvfp4 bf16 --batches 64 256 --budget 220 \
    --out "$OUT/live" > "$OUT/live_log.txt" 2>&1
  tail -6 "$OUT/live_log.txt" ;;
vllm)
  fmt="${1:?format}"; shift
  [ "$fmt" != nf4 ] || bitsandbytes
  timeout "${VLLM_TIMEOUT:-330}" python3 -m bench.bench_vllm_lengths --formats "$fmt" --budget 260 --out "$OUT/vllm" "$@" \
    > "$OUT/vllm_${fmt}_log.txt" 2>&1
  grep -E "vLLM|Error|error|Maximum concurrency" "$OUT/vllm_${fmt}_log.txt" | tail -20 ;;
grpo-engines)
  fmt="${1:?format}"
  timeout 330 python3 -m bench.bench_grpo_engines --formats "$fmt" --out "$OUT/grpo" > "$OUT/grpo_${fmt}_log.txt" 2>&1
  grep -E "step #|adapter|failed|Error" "$OUT/grpo_${fmt}_log.txt" | tail -20 ;;
memory)
  # one process per case (bench.bench_memory --isolate auto); table, JSON and peaks file rewritten after each
  cp tests/data/measured_peaks.json "$OUT/measured_peaks.json"
  timeout "${MEM_TIMEOUT:-560}" python3 -m bench.bench_memory --out "$OUT/memory" --append "$OUT/measured_peaks.json" \
    --budget "${MEM_BUDGET:-420}" --limit 540 "$@" > "$OUT/memory_log.txt" 2>&1; echo "bench_memory rc=$?"
  grep -E "step|failed|Error|appended|measured" "$OUT/memory_log.txt" | tail -12; cat "$OUT/memory/memory.md" 2>/dev/null
  # a call returns at most 8 files: the logs (one per case) travel as one archive
  mv "$OUT/memory_log.txt" "$OUT/memory/"
  (cd "$OUT/memory" && tar czf logs.tgz --remove-files $(ls -d ./*_log.txt run 2>/dev/null)) 2>/dev/null ;;
gpu-tests)
  files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/test_held_weight.py tests/test_dense_update.py tests/test_dense_cache_kernels.py
    tests/test_old_policy.py tests/test_lut4_kernels.py tests/test_engine_memory.py tests/test_memory_plan.py
    tests/test_bench_step.py tests/test_engine_fused.py tests/test_routes.py tests/test_kernel_report.py)
  case " ${files[*]} " in *test_bench_trl_step*)  # trl, datasets, bitsandbytes, unsloth; vLLM where installed
    [ ! -f .vllm/uns/slim.tgz ] || bitsandbytes; [ ! -f /tmp/exports.sh ] || eval "$(tail -1 /tmp/exports.sh)" ;; esac
  timeout -s INT "${TESTS_TIMEOUT:-540}" python3 -m pytest "${files[@]}" -q -rsxX -p no:cacheprovider -W always > "$OUT/gpu_tests_log.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR|XPASS)|UserWarning: .*(differ|max)" "$OUT/gpu_tests_log.txt" | head -30
  tail -2 "$OUT/gpu_tests_log.txt" ;;
profile-update)
  read -r -a fmts <<< "${2:-nvfp4 none}"; mkdir -p "$OUT/profile-update"
  read -r -a shape <<< "${UPDATE_ARGS:---micro-batch 8 --micro-batches 2 --prompt 256 --completion 512 --checkpointing --repeats 2}"
  timeout "${PROFILE_TIMEOUT:-400}" python3 -m bench.bench_dense_cache --model "${1:-Qwen2.5-7B}" --formats "${fmts[@]}" \
    "${shape[@]}" --profile "$OUT/profile-update" > "$OUT/profile-update/log.txt" 2>&1
  echo "profile rc=$?"; grep -E "^\| |Error" "$OUT/profile-update/log.txt" | head -12 ;;
fair)
  mkdir -p "$OUT/fair"; bnb=(); variants=(engine-nvfp4 engine-nf4 engine-mxfp4)
  if [ -f .vllm/uns/slim.tgz ] || ls .vllm/bnb/*.whl > /dev/null 2>&1; then bitsandbytes; bnb=(--bnb); variants+=(hf-nf4); fi
  timeout "${FAIR_LUT4_TIMEOUT:-240}" python3 -m bench.bench_lut4 "${bnb[@]}" --out "$OUT/fair/lut4" > /tmp/fair_lut4_log.txt 2>&1
  echo "lut4 rc=$?"; head -40 "$OUT/fair/lut4/lut4.md" 2>/dev/null
  read -r -a batches <<< "${BATCHES:-1 8 64}"
  timeout "${FAIR_ENGINE_TIMEOUT:-300}" python3 -m bench.bench_rollout --parts rollout --models Qwen2.5-7B \
    --variants "${variants[@]}" --batches "${batches[@]}" --budget 240 --out "$OUT/fair/engine" > /tmp/fair_engine_log.txt 2>&1
  echo "engine rc=$?"; grep -E "ms/step|failed|Error" /tmp/fair_engine_log.txt | tail -20
  (cd /tmp && tar czf "$OUT/fair/logs.tgz" fair_lut4_log.txt fair_engine_log.txt) ;;
lut4-sweep)
  mkdir -p "$OUT/lut4-sweep"; timeout "${SWEEP_TIMEOUT:-540}" python3 -m bench.bench_lut4_sweep --out "$OUT/lut4-sweep" > /tmp/sweep_log.txt 2>&1
  echo "sweep rc=$?"; cut -d'|' -f2-4,7,15- "$OUT/lut4-sweep/sweep.md" 2>/dev/null | head -40; cp /tmp/sweep_log.txt "$OUT/lut4-sweep/" ;;
pyspy-update)
  read -r -a fmts <<< "${2:-none nvfp4}"; mkdir -p "$OUT/pyspy"; rate="${PYSPY_RATE:-50}"
  read -r -a shape <<< "${UPDATE_ARGS:---micro-batch 8 --micro-batches 8 --prompt 256 --completion 512 --repeats 4}"
  pyspy="${PYSPY:-/tmp/site/bin/py-spy}"  # carried_wheels installs it from .whl/prof
  [ -x "$pyspy" ] || { echo "py-spy is not installed ($pyspy): carry its wheel in .whl/prof"; exit 2; }
  for f in "${fmts[@]}"; do
    OMP_NUM_THREADS="${PYSPY_THREADS:-1}" timeout "${PYSPY_TIMEOUT:-240}" "$pyspy" record -r "$rate" --native --format raw -o "/tmp/pyspy_$f.txt" -- \
      python3 -m bench.bench_dense_cache --model "${1:-Qwen2.5-0.5B}" --formats "$f" --modes dense "${shape[@]}" \
      --out "$OUT/pyspy/table_$f.md" > "$OUT/pyspy/log_$f.txt" 2>&1; echo "$f rc=$?"; grep "^| $f " "$OUT/pyspy/table_$f.md"
  done
  python3 -m bench.pyspy_diff "/tmp/pyspy_${fmts[0]}.txt" "/tmp/pyspy_${fmts[1]}.txt" --labels "${fmts[@]:0:2}" --rate "$rate" \
    --out "$OUT/pyspy/diff.md" > /dev/null; head -30 "$OUT/pyspy/diff.md"
  (cd /tmp && tar czf "$OUT/pyspy/raw.tgz" pyspy_*.txt) ;;
engine-ab)
  read -r -a fmts <<< "${2:-none nvfp4}"; mkdir -p "$OUT/engine-ab"
  read -r -a shape <<< "${UPDATE_ARGS:---micro-batch 8 --micro-batches 8 --prompt 256 --completion 512 --repeats 4}"
  for f in "${fmts[@]}"; do
    for run in ${AB_RUNS:-alone after-engine after-freed}; do  # a name's parts: after, freed, frozen
      extra=(); [[ $run == *after* ]] && extra=(--after-engine "${ENGINE_NEW:-512}"); [[ $run == *freed* ]] && extra+=(--free-engine)
      [[ $run == *frozen* ]] && extra+=(--gc-freeze)
      timeout "${AB_TIMEOUT:-240}" python3 -m bench.bench_dense_cache --model "${1:-Qwen2.5-1.5B}" --formats "$f" --modes dense \
        "${shape[@]}" "${extra[@]}" --out "$OUT/engine-ab/$f-$run.md" > "$OUT/engine-ab/log_$f-$run.txt" 2>&1
      echo "$f $run rc=$?: $(grep "^| $f " "$OUT/engine-ab/$f-$run.md" 2>/dev/null)"
    done
  done
  (cd "$OUT/engine-ab" && tar czf logs.tgz --remove-files log_*.txt) ;;
trim)
  read -r -a fmts <<< "${2:-none nvfp4}"; mkdir -p "$OUT/trim"
  read -r -a modes <<< "${TRIM_MODES:-padded trimmed sorted packed}"
  timeout "${TRIM_TIMEOUT:-500}" python3 -m bench.bench_trim --model "${1:-Qwen2.5-7B}" --formats "${fmts[@]}" --checkpointing \
    --repeats "${TRIM_REPEATS:-2}" --modes "${modes[@]}" --out "$OUT/trim/trim.md" > "$OUT/trim/log.txt" 2>&1
  echo "bench_trim rc=$?"; grep -E "^\| |Error" "$OUT/trim/log.txt" | tail -8 ;;
routes)
  read -r -a models <<< "${1:-Qwen2.5-0.5B Qwen2.5-1.5B}"; read -r -a ms <<< "${2:-1 8 64}"; mkdir -p "$OUT/routes"
  timeout "${ROUTES_TIMEOUT:-400}" python3 -m bench.bench_routes --models "${models[@]}" --ms "${ms[@]}" \
    --budget-s "${ROUTES_BUDGET:-300}" --out "$OUT/routes" > "$OUT/routes/log.txt" 2>&1
  echo "bench_routes rc=$?"; grep -vi warn "$OUT/routes/log.txt" | tail -12 ;;
hc-save)  # humming's compiled kernels of this hold as $OUT/hc/hc.tgz.part_*: copy them to .whl/hc/, carry .whl next time
  # (in pieces of 15 MiB: a file over 16 MiB does not come back; a 7B + 14B + 32B hold made 17 MB)
  mkdir -p "$OUT/hc" && tar -cz -C /tmp/hc --exclude=.carried --exclude='*.lock' . | split -b 15M - "$OUT/hc/hc.tgz.part_" \
    && echo "hc-save: $(find /tmp/hc -name kernel.cubin | wc -l) kernels, $(du -ch "$OUT"/hc/hc.tgz.part_* | tail -1 | cut -f1)" ;;
repro-tests)
  timeout 540 python3 -m pytest tests/test_tuning.py -q -rxX -p no:cacheprovider > "$OUT/repro_tests_log.txt" 2>&1
  echo "autotune tests rc=$?"; grep -E "^(XPASS|XFAIL|FAILED)" "$OUT/repro_tests_log.txt"; tail -1 "$OUT/repro_tests_log.txt" ;;
repro)
  timeout 240 python3 -m bench.bench_repro --processes 3 --model tiny --new 64 --out "$OUT/repro_tiny" "$@" \
    > "$OUT/repro_tiny_log.txt" 2>&1; echo "tiny rc=$?"; tail -4 "$OUT/repro_tiny/repro.md"
  if model_checked; then  # written by model-setup only after the GGUF's sha256 matched
    timeout 320 python3 -m bench.bench_repro --processes 3 --preset real-gsm8k --model /tmp/model.gguf --new "${REPRO_NEW:-384}" --temperature 1.0 \
      --out "$OUT/repro_real" "$@" > "$OUT/repro_real_log.txt" 2>&1; echo "real ${REAL_MODEL:-0.5b} rc=$?"; tail -4 "$OUT/repro_real/repro.md"
  else
    echo "real ${REAL_MODEL:-0.5b}: skipped (no checked /tmp/model.gguf of it: run model-piece 01.. and model-setup first)"
  fi
  # at most 8 files come back: repro.md of each run loose, the rest (logs, repro.json, autotune.json) in one archive
  (cd "$OUT" && tar czf repro_logs.tgz --remove-files $(ls ./*_log.txt repro_*/repro.json repro_*/autotune.json \
    repro_*/process*.json 2>/dev/null)) 2>/dev/null ;;
nb05)
  python3 -m bench.install_missing_wheels .whl/nb --target /tmp/nbsite && export PYTHONPATH="/tmp/nbsite:$PYTHONPATH"
  timeout "${NB_TIMEOUT:-500}" python3 scripts/execute_notebooks.py notebooks/05_gpu_real_model.ipynb --out "$OUT/nb05" \
    > "$OUT/nb05_log.txt" 2>&1; echo "notebook 05 rc=$?"; tail -20 "$OUT/nb05_log.txt" ;;
lora-tiling)
  mkdir -p "$OUT/lora-tiling"
  if [ "${TILING_TESTS:-1}" != 0 ]; then  # the grouped-LoRA tests compiled (tilings, the shrink's own sum)
    timeout 200 python3 -m pytest tests/test_engine_fused.py -q -x -p no:cacheprovider -k "lora or tiling or shrink" \
      > "$OUT/lora-tiling/tests_log.txt" 2>&1; echo "grouped-LoRA tests rc=$?"; tail -2 "$OUT/lora-tiling/tests_log.txt"
  fi
  timeout "${TILING_TIMEOUT:-450}" python3 -m bench.bench_lora_tiling --model "${1:-Qwen2.5-7B}" --out "$OUT/lora-tiling" \
    --grid "${TILING_GRID:-full}" > "$OUT/lora-tiling/log.txt" 2>&1
  echo "bench_lora_tiling rc=$?"; grep -E "^Tiling\(\)|^Fastest|Error" "$OUT/lora-tiling/lora_tiling.md" "$OUT/lora-tiling/log.txt" | tail -6
  tiling="${2:-}"; [ "$tiling" != auto ] || tiling=$(cat "$OUT/lora-tiling/best.txt" 2>/dev/null)
  if [ -n "$tiling" ]; then
    timeout "${ENGINE_TIMEOUT:-300}" python3 -m bench.bench_lora_engine --model "${1:-Qwen2.5-7B}" --tiling "$tiling" --batches 8 64 \
      --out "$OUT/lora-tiling" > "$OUT/lora-tiling/engine_log.txt" 2>&1; echo "bench_lora_engine rc=$?"
    grep "^|" "$OUT/lora-tiling/lora_engine_h200.md" 2>/dev/null
  fi ;;
census)
  for m in ${1:-Qwen2.5-32B Qwen2.5-7B}; do
    timeout "${CENSUS_TIMEOUT:-240}" python3 -m bench.probe_memory_census --model "$m" --out "$OUT/census-$m" ${CENSUS_ARGS:-} \
      > "$OUT/census-$m.log.txt" 2>&1; echo "$m census rc=$?"; grep -E "^\[census\]|Error" "$OUT/census-$m.log.txt" | tail -5
  done ;;
unsloth)
  tar -xzf .vllm/uns/slim.tgz -C /tmp && export PYTHONPATH="/tmp/slim:$PYTHONPATH"
  TMPDIR=/dev/shm timeout 420 python3 -m bench.probe_unsloth --out "$OUT/unsloth" --budget 330 > "$OUT/unsloth_log.txt" 2>&1
  grep "^\[probe\]" "$OUT/unsloth_log.txt" | tail -20 ;;
step7b|step-model|step-paper|step-vllm|step05b-real)
  # one bench.bench_step call per table; --budget stops new (format, engine) groups in time for the tail
  # the tag names the arguments and STEP_ARGS, e.g. step7b-nf4-mxfp4: calls of one command keep apart (a comma
  # becomes a dash: the device tool returns no file under a name with one)
  tag=$(echo "$cmd" "$@" ${STEP_ARGS:-} | tr -s ' :,' '---')
  [ "$cmd" = step05b-real ] && [ "${REAL_MODEL:-0.5b}" = 1.5b ] && tag="step15b-real${tag#step05b-real}"
  case " $* " in *bnb-nf4*) bitsandbytes ;; esac  # bitsandbytes' NF4 layers (the field's QLoRA)
  common=(--steps "${STEP_STEPS:-2}" --budget "${STEP_BUDGET:-400}" --limit "${STEP_LIMIT:-540}" --out "$OUT/$tag")
  case "$cmd" in
  step7b) read -r -a fmts <<< "${1:-none nvfp4}"; read -r -a ckpt <<< "${2:-off on}"
    args=(--models Qwen2.5-7B --formats "${fmts[@]}" --lengths fixed:512 --gradient-checkpointing "${ckpt[@]}") ;;
  step-model) read -r -a fmts <<< "${2:-none nvfp4}"; read -r -a ckpt <<< "${3:-on}"
    args=(--models "${1:?model}" --formats "${fmts[@]}" --lengths fixed:512 --gradient-checkpointing "${ckpt[@]}")
    case "$1" in *32B*|*72B*) args+=(--dense-cache auto) ;; esac ;;  # all of a 32B's dense copy would not fit
  step-paper) read -r -a fmts <<< "${1:-none nvfp4}"
    args=(--models Qwen2.5-7B --formats "${fmts[@]}" --lengths "${3:-paper}" --prompts 16 --gradient-checkpointing on
          --mu "${2:-1}") ;;
  step-vllm) fmt="${1:?format}"; [ "$fmt" != nf4 ] || bitsandbytes
    args=(--models Qwen2.5-7B --formats "$fmt" --engines static vllm --lengths fixed:512) ;;
  step05b-real) read -r -a fmts <<< "${1:-none nvfp4}"; read -r -a lens <<< "${2:-fixed:512 natural:512}"
    model_checked && [ -f "$MODEL_DIR/config.json" ] \
      || { echo "step05b-real: no checked and converted real ${REAL_MODEL:-0.5b} ($MODEL_DIR): run model-setup first" >&2; exit 2; }
    read -r -a engines <<< "${ENGINES:-static}"  # ENGINES="static vllm" after the vLLM pieces' install.sh
    args=(--models "$MODEL_DIR" --formats "${fmts[@]}" --lengths "${lens[@]}" --prompts 16 --mu 4 --lora-r 16
          --engines "${engines[@]}") ;;
  esac
  read -r -a extra <<< "${STEP_ARGS:-}"  # more bench_step flags, e.g. STEP_ARGS="--max-rows 32 --keep-cache off"
  timeout "${STEP_TIMEOUT:-560}" python3 -m bench.bench_step run "${args[@]}" "${common[@]}" "${extra[@]}" > "$OUT/${tag}_log.txt" 2>&1
  echo "bench_step rc=$?"; grep -E "step #1|failed|exit|Error" "$OUT/${tag}_log.txt" | grep -v Warning | tail -16
  sed -n '/^## NVFP4/,$p' "$OUT/$tag/step.md" 2>/dev/null | head -30
  # at most 8 files come back: step.csv, step.md and step.png loose; rows.jsonl and every log in one archive
  mkdir -p "$OUT/$tag" && mv "$OUT/${tag}_log.txt" "$OUT/$tag/"
  (cd "$OUT/$tag" && tar czf logs.tgz --remove-files $(ls rows.jsonl ./*log.txt ./profile_*.txt 2>/dev/null)) 2>/dev/null ;;
layout-ab)
  # the training forward's two layouts, one after the other on this machine (bench_step --layout): any step
  # command and its arguments, e.g. `layout-ab step-model Qwen2.5-0.5B "none nvfp4" off`; each table's folder is
  # packed into <tag>.tgz, so both tables' files fit the 8 a call returns
  for layout in aligned padded; do
    STEP_ARGS="${STEP_ARGS:-} --layout $layout" bash "$0" "$@"
    (cd "$OUT" && for d in */; do [ -d "$d" ] && tar czf "${d%/}.tgz" "$d" && rm -rf "$d"; done)
  done ;;
step-trl)
  read -r -a stacks <<< "${1:-trl-nf4 trl-bf16 unsloth}"; model="${2:-Qwen2.5-7B}"; shift $(( $# < 2 ? $# : 2 ))
  tag=$(echo "$cmd" "${stacks[@]}" "$model" | tr -s ' :/' '---')
  if [ -f .vllm/uns/slim.tgz ]; then  # unsloth, unsloth_zoo, trl, datasets, bitsandbytes
    tar -xzf .vllm/uns/slim.tgz -C /tmp && export PYTHONPATH="/tmp/slim:$PYTHONPATH"
  else
    echo "step-trl: no .vllm/uns/slim.tgz (bench/make_unsloth_carry.sh): trl, unsloth and bitsandbytes only if installed"
  fi
  # vLLM from the vLLM pieces' install.sh of this hold, where the call did not already put it on the path
  [ ! -f /tmp/exports.sh ] || eval "$(tail -1 /tmp/exports.sh)"
  # a preset's random checkpoint stays in /dev/shm for the hold: a later step-trl call reuses it (same weights)
  TMPDIR=/dev/shm timeout 560 python3 -m bench.bench_trl_step --stacks "${stacks[@]}" --model "$model" --prompts 8 \
    --group 8 --new 512 --prompt-len 256 --micro-batch 8 --mu 1 --lora-r 32 --gradient-checkpointing on --steps 3 \
    --budget "${TRL_BUDGET:-400}" --limit 540 --keep-checkpoint /dev/shm/trl-ckpt --out "$OUT/$tag" "$@" \
    > "$OUT/${tag}_log.txt" 2>&1
  echo "bench_trl_step rc=$?"; grep -E "process exit|Error|error" "$OUT/${tag}_log.txt" | grep -v Warning | tail -12
  sed -n '/^| stack/,/^$/p' "$OUT/$tag/step.md" 2>/dev/null
  # at most 8 files come back: step.md loose; rows.jsonl and every log in one archive
  mkdir -p "$OUT/$tag" && mv "$OUT/${tag}_log.txt" "$OUT/$tag/"
  (cd "$OUT/$tag" && tar czf logs.tgz --remove-files $(ls rows.jsonl ./*log.txt ./profile_*.txt 2>/dev/null)) 2>/dev/null ;;
countdown)
  mkdir -p /tmp/cd "$OUT/cd"
  # the knob is the near-miss share; each stops once held-out greedy accuracy reaches 30% (the band is 10-40%)
  for miss in 0.0 0.4 0.7; do
    HUMMING_CACHE_DIR=/tmp/hc_cd$miss python3 scripts/train_countdown.py --device cuda --out /tmp/cd/m$miss \
      --miss $miss --time-budget 120 --stop-at-acc 0.3 --eval-every 300 --final-eval-n 300 > /tmp/cd/log_m$miss.txt 2>&1 &
  done
  wait
  python3 -m bench.countdown_pick calibration "$OUT"
  tar -C /tmp/cd -czf "$OUT/cd/logs.tgz" $(cd /tmp/cd && ls log_*.txt)
  tail -n 3 /tmp/cd/log_*.txt ;;
cdtrain)
  mkdir -p /tmp/cd "$OUT/cd"
  python3 scripts/train_countdown.py --device cuda --out /tmp/cd/m0.0 --miss 0.0 --stop-at-step 747 \
    --eval-every 300 --final-eval-n 300 > /tmp/cd/log_m0.0.txt 2>&1 || { tail -5 /tmp/cd/log_m0.0.txt; exit 1; }
  echo /tmp/cd/m0.0 > /tmp/cd/chosen_path
  grep -E "accuracy|stopped" /tmp/cd/log_m0.0.txt; cp /tmp/cd/log_m0.0.txt /tmp/cd/m0.0/train_report.json "$OUT/cd/"
  (cd /tmp/cd/m0.0 && sha256sum *.safetensors) > "$OUT/cd/model_sha256.txt"
  diff <(awk '{print $1}' bench/results/experiments_countdown_h200/calibration/model_sha256.txt | sort) \
       <(awk '{print $1}' "$OUT/cd/model_sha256.txt" | sort) > /dev/null \
    && echo "shards: identical to the committed sha256" || echo "shards: differ from the committed sha256"
  tar -C /tmp/cd -cf /tmp/cd/model.tar m0.0 && split -b 15m /tmp/cd/model.tar "$OUT/cd/model.tar.part_" ;;
cdgrid)
  model="${1:-$(cd_model)}"
  [ -n "$model" ] || { echo "cdgrid: no model (run countdown or cdtrain first, carry .vllm/cd, or name one)" >&2; exit 2; }
  lr="${4:-2e-3}"; [ "$lr" != best ] || lr=$(cat /tmp/cd/best_lr) || exit 2
  dir="cdgrid-s${3:-150}-lr$lr"  # one directory per setting: a grid never mixes steps or lrs
  [ -z "${CD_CONFIGS:-}" ] || dir="$dir-sub"
  [ -d "/tmp/$dir" ] || [ ! -f .vllm/cdgrid/parts.tgz ] || tar -xzf .vllm/cdgrid/parts.tgz -C /tmp  # earlier holds' runs
  GRID_CONFIGS="${CD_CONFIGS:-}" SEED_GROUPS="${SEED_GROUPS:-0,1,2 3,4}" bash scripts/grid_parallel.sh "/tmp/$dir" full \
    "${2:-480}" --device cuda --model "$model" --dataset countdown --steps "${3:-150}" --lr "$lr" --eval-every 25 \
    > /tmp/cdgrid_log.txt 2>&1
  echo "grid $dir rc=$?"; tail -12 /tmp/cdgrid_log.txt
  tar -C /tmp -czf "$OUT/cdgrid_parts.tgz" "$dir" ;;
cdsweep)
  model="$(cd_model)"
  [ -n "$model" ] || { echo "cdsweep: no model (run countdown or cdtrain first, or carry .vllm/cd)" >&2; exit 2; }
  read -r -a lrs <<< "${3:-2.5e-4 5e-4 1e-3}"
  mkdir -p /tmp/cdsweep
  for lr in "${lrs[@]}"; do
    for c in nvfp4-lora bf16-lora-4bit-lr; do  # the same lr for both: bf16's control runs at the 4-bit lr
      for seed in 0 1; do
        OMP_NUM_THREADS=1 timeout "${1:-300}" python3 -m qerl_kit.experiments --grid full --configs "$c" --seeds $seed \
          --device cuda --model "$model" --dataset countdown --steps "${2:-150}" --eval-every 25 --lr "$lr" \
          --out "/tmp/cdsweep/lr$lr/$c-s$seed" > "/tmp/cdsweep/lr${lr}_$c-s$seed.log" 2>&1 &
      done
    done
  done
  wait
  python3 -m bench.countdown_pick lr
  tar -C /tmp -czf "$OUT/cdsweep.tgz" cdsweep ;;
model-piece)
  n="${1:?piece number}"
  [ "$n" = 01 ] && rm -f /tmp/model.gguf
  rm -f /tmp/model.sha256.ok  # the file changes: unchecked until model-setup
  cat "$PIECES/p$n/part" >> /tmp/model.gguf && ls -l /tmp/model.gguf ;;
model-setup)
  n="${1:?last piece number}"
  rm -f /tmp/model.sha256.ok
  cat "$PIECES/p$n/part" >> /tmp/model.gguf
  echo "$MODEL_SHA  /tmp/model.gguf" | sha256sum -c - || exit 1
  echo "$MODEL_SHA" > /tmp/model.sha256.ok  # repro and step05b-real test this: the whole file, checked
  mkdir -p /tmp/data && cp .rdata/*.jsonl /tmp/data/
  python3 -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__)"
  python3 -m bench.real_model convert /tmp/model.gguf "$MODEL_DIR" 2>&1 | grep -v "it/s\]" ;;
real-eval)
  tag="${EVAL_TAG:-eval}"  # the JSONs travel as one archive ($OUT returns a few files)
  timeout "${LIMIT_S:-560}" python3 -m bench.real_model eval "$MODEL_DIR" --out "/tmp/$tag" "$@" 2>&1 | grep -v "it/s\]"
  cp "/tmp/$tag/summary.md" "$OUT/$tag-summary.md"; tar czf "$OUT/$tag.tgz" -C /tmp "$tag" ;;
real-regress)
  timeout "${LIMIT_S:-560}" python3 -m bench.real_model regress "$MODEL_DIR" --out /tmp/regress "$@" 2>&1 | grep -v "it/s\]"
  cp /tmp/regress/regress.json "$OUT/" ;;
engine-policy)
  model_checked || { echo "engine-policy: no checked and converted real ${REAL_MODEL:-0.5b}: run model-setup first" >&2; exit 2; }
  carried_wheels; humming_cache
  timeout "${LIMIT_S:-570}" python3 -m bench.probe_engine_policy "$MODEL_DIR" --out "$OUT/policy" "$@" 2>&1 \
    | grep -v "it/s\]" | tail -60 ;;
real-grpo)
  mkdir -p /tmp/grpo
  timeout "${LIMIT_S:-540}" python3 -m bench.real_grpo run "$MODEL_DIR" --out /tmp/grpo "$@" 2>&1 | grep -v "it/s\]"
  python3 -m bench.real_grpo report /tmp/grpo
  mkdir -p "$OUT/grpo" && cp /tmp/grpo/study.md /tmp/grpo/curves.json "$OUT/grpo/" 2>/dev/null
  (cd /tmp/grpo && tar czf "$OUT/grpo/runs.tgz" --exclude='checkpoint-*' */metrics.jsonl */final.json */log.txt 2>/dev/null) ;;
*) echo "unknown command $cmd (the list is at the top of bench/device.sh)" >&2; exit 2 ;;
esac
ls -R "$OUT" | head -30
