#!/usr/bin/env bash
# Issue #25/#26/#28 device runs on one H200, in the order one vLLM hold takes them (the vLLM parts
# travel in three calls: DEVELOPERS.md; since the tracked files passed ~13 MB, re-cut them first with
# `bash bench/vllm_carry.sh`, which prints each call's carry). Each part writes under $OUT and prints
# a short tail.
#   bash bench/run_h200_rollout.sh countdown   # #28: Countdown model calibration (3 configs at once; ~5 min)
#   bash bench/run_h200_rollout.sh cdtrain     # #28: the shipped calibration alone (--miss 0.0, step 747; ~2 min),
#                                              #      its shards' sha256 checked against the committed ones
#   bash bench/run_h200_rollout.sh cdgrid [MODEL] [LIMIT_S] [STEPS] [LR]  # #28: the grid on Countdown (7 configs x 5
#                                              #      seeds, two processes per config; MODEL default: this hold's
#                                              #      countdown/cdtrain model; LR "best": cdsweep's choice);
#                                              #      resumable: again in the hold, or carry .vllm/cdgrid/parts.tgz;
#                                              #      CD_CONFIGS="bf16-lora nvfp4-lora" runs only those (directory
#                                              #      cdgrid-s<STEPS>-lr<LR>-sub), SEED_GROUPS overrides "0,1,2 3,4"
#   bash bench/run_h200_rollout.sh cdsweep [LIMIT_S] [STEPS] ["LRS"]  # #28: lr sweep on Countdown, bf16 and NVFP4 at
#                                              #      the same lr (default 2.5e-4 5e-4 1e-3), seeds 0 1, one process
#                                              #      per (lr, format, seed); picks the 4-bit lr (/tmp/cd/best_lr)
#   bash bench/run_h200_rollout.sh engine32b ["VARIANTS"]  # #25: 32B fixed lengths (1/8/64/256, groups of 8); e.g. "engine-nvfp4"
#   bash bench/run_h200_rollout.sh engine7b    # #25: compiled engine-kernel tests, then 7B fixed lengths (1/8/64/256, groups of 8)
#   bash bench/run_h200_rollout.sh live7b      # #25: 7B realistic lengths (live-row compaction)
#   bash bench/run_h200_rollout.sh vllm FMT [ARGS]  # #25/#26: vLLM 0.26 (after .vllm/p3/install.sh's exports), FMT
#                                              #      nvfp4|bf16|nf4; ARGS go to bench_vllm_lengths (e.g. --fixed-batches
#                                              #      with no value: the realistic-length runs only; at 32B:
#                                              #      VLLM_TIMEOUT=560 ... vllm nvfp4 --model Qwen2.5-32B --batches
#                                              #      --budget 500 --out $OUT/vllm32b, and for bf16 add
#                                              #      --dummy-weights --gpu-util 0.93: bench_vllm_lengths' docstring)
#                                              #      (nf4: bitsandbytes from .vllm/uns/slim.tgz or .vllm/bnb/*.whl, carried)
#   bash bench/run_h200_rollout.sh grpo FMT    # #26: one whole GRPO step on StaticEngine and on vLLM, FMT nvfp4|bf16
#   bash bench/run_h200_rollout.sh nb05        # #26: notebook 05 on the GPU with vLLM, after the exports; the Jupyter
#                                              #      stack from bench/make_notebook_carry.sh (.whl/nb, ~40 MB, its own call)
#   bash bench/run_h200_rollout.sh unsloth     # #26: Unsloth's own GRPO rollout path (bench/probe_unsloth.py), after
#                                              #      the vLLM exports; carry .vllm/uns (bench/make_unsloth_carry.sh)
#
# Issue #26's whole table in one hold (about 1,500 s of device time; the vLLM pieces from
# bench/vllm_carry.sh ride in calls 1-3, one call straight after the other):
#   1. ENGINE_TESTS=0 BATCHES="8 64 256" ... engine7b      2. ... live7b
#   3. (install) ... vllm nvfp4 --fixed-batches 8 64 256   4. ... vllm bf16 --fixed-batches 8 64 256
#   5. ... grpo nvfp4; ... grpo bf16                      6. (carry .whl) ... nb05
# Ran 2026-12-03 (bench/results/same_day_h200_2026-12-03b.md): calls 1-4 took 160 / 195 / 235 / 207 s
# of wall; the machine went back before call 5 because more than 30 s passed between two calls, so
# have every next command ready. A fresh hold needs the three vLLM calls again (cp only: seconds).
set -uo pipefail
part="${1:?part}"
OUT="${OUT:?set OUT}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/h19 .whl/h19/*.whl .whl/common/*.whl 2>/dev/null
export PYTHONPATH="/tmp/h19:${PYTHONPATH:-}:$PWD" HUMMING_CACHE_DIR=/tmp/hc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
cd_model() {  # the Countdown model: this hold's countdown part, else the one carried in .vllm/cd (model.tar.part_*)
  if [ -f /tmp/cd/chosen_path ]; then cat /tmp/cd/chosen_path; return; fi
  if ls .vllm/cd/model.tar.part_* > /dev/null 2>&1; then
    mkdir -p /tmp/cd && cat .vllm/cd/model.tar.part_* | tar -x -C /tmp/cd && d=$(ls -d /tmp/cd/m* | head -1) \
      && echo "$d" > /tmp/cd/chosen_path && echo "$d"
  fi
}
case "$part" in
countdown)
  mkdir -p /tmp/cd "$OUT/cd"
  # three calibrations side by side (small models: the GPU has room); the knob is the near-miss share,
  # and each stops once held-out greedy accuracy reaches 30% (the band is 10-40%)
  for miss in 0.0 0.4 0.7; do
    HUMMING_CACHE_DIR=/tmp/hc_cd$miss python3 scripts/train_countdown.py --device cuda --out /tmp/cd/m$miss \
      --miss $miss --time-budget 120 --stop-at-acc 0.3 --eval-every 300 --final-eval-n 300 > /tmp/cd/log_m$miss.txt 2>&1 &
  done
  wait
  python3 - <<'PY'
import json, os, pathlib, shutil, subprocess
out = pathlib.Path(os.environ["OUT"]) / "cd"
rep = {}
for d in sorted(pathlib.Path("/tmp/cd").glob("m*")):
    f = d / "train_report.json"
    if f.exists():
        r = json.loads(f.read_text())
        rep[d.name] = r
        c = r["calibration"]
        print(d.name, "steps", r["steps"], "s", r["seconds"], {k: (round(v["accuracy"], 3), round(v["pass_at_k"], 3)) for k, v in c.items()})
(out / "reports.json").write_text(json.dumps(rep, indent=1, default=str))
def score(r):  # greedy (NVFP4) in 10-40% and the largest pass@8 - greedy gap; otherwise nearest to 25%
    g = r["calibration"]["greedy_nvfp4"]["accuracy"]; p = r["calibration"]["sampled_t1_nvfp4"]["pass_at_k"]
    return (0.10 <= g <= 0.40, p - g if 0.10 <= g <= 0.40 else -abs(g - 0.25))
if rep:
    best = max(rep, key=lambda k: score(rep[k]))
    print("chosen", best)
    (pathlib.Path("/tmp/cd") / "chosen_path").write_text(f"/tmp/cd/{best}")  # for cdgrid, later in the hold
    subprocess.run(f"tar -C /tmp/cd -cf /tmp/cd/model.tar {best} && split -b 15m /tmp/cd/model.tar {out}/model.tar.part_", shell=True, check=True)
PY
  tar -C /tmp/cd -czf "$OUT/cd/logs.tgz" $(cd /tmp/cd && ls log_*.txt)
  tail -n 3 /tmp/cd/log_*.txt
  ;;
cdtrain)
  mkdir -p /tmp/cd "$OUT/cd"
  python3 scripts/train_countdown.py --device cuda --out /tmp/cd/m0.0 --miss 0.0 --stop-at-step 747 \
    --eval-every 300 --final-eval-n 300 > /tmp/cd/log_m0.0.txt 2>&1 || { tail -5 /tmp/cd/log_m0.0.txt; exit 1; }
  echo /tmp/cd/m0.0 > /tmp/cd/chosen_path
  grep -E "accuracy|stopped" /tmp/cd/log_m0.0.txt; cp /tmp/cd/log_m0.0.txt /tmp/cd/m0.0/train_report.json "$OUT/cd/"
  (cd /tmp/cd/m0.0 && sha256sum *.safetensors) > "$OUT/cd/model_sha256.txt"
  diff <(awk '{print $1}' docs/results/experiments-countdown/calibration/model_sha256.txt | sort) \
       <(awk '{print $1}' "$OUT/cd/model_sha256.txt" | sort) > /dev/null \
    && echo "shards: identical to the committed sha256" || echo "shards: differ from the committed sha256"
  tar -C /tmp/cd -cf /tmp/cd/model.tar m0.0 && split -b 15m /tmp/cd/model.tar "$OUT/cd/model.tar.part_"
  ;;
cdgrid)
  model="${2:-$(cd_model)}"
  [ -n "$model" ] || { echo "cdgrid: no model (run the countdown part first, carry .vllm/cd, or name one)" >&2; exit 2; }
  lr="${5:-2e-3}"; [ "$lr" != best ] || lr=$(cat /tmp/cd/best_lr) || exit 2
  dir="cdgrid-s${4:-150}-lr$lr"  # one directory per setting: a grid never mixes steps or lrs
  [ -z "${CD_CONFIGS:-}" ] || dir="$dir-sub"  # a subset of the configurations (a longer run of a few)
  [ -d "/tmp/$dir" ] || [ ! -f .vllm/cdgrid/parts.tgz ] || tar -xzf .vllm/cdgrid/parts.tgz -C /tmp  # earlier holds' runs
  GRID_CONFIGS="${CD_CONFIGS:-}" SEED_GROUPS="${SEED_GROUPS:-0,1,2 3,4}" bash scripts/grid_parallel.sh "/tmp/$dir" full "${3:-480}" --device cuda --model "$model" \
    --dataset countdown --steps "${4:-150}" --lr "$lr" --eval-every 25 > /tmp/cdgrid_log.txt 2>&1
  echo "grid $dir rc=$?"; tail -12 /tmp/cdgrid_log.txt
  tar -C /tmp -czf "$OUT/cdgrid_parts.tgz" "$dir"
  ;;
cdsweep)
  model="$(cd_model)"
  [ -n "$model" ] || { echo "cdsweep: no model (run the countdown part first, or carry .vllm/cd)" >&2; exit 2; }
  read -r -a lrs <<< "${4:-2.5e-4 5e-4 1e-3}"
  mkdir -p /tmp/cdsweep
  for lr in "${lrs[@]}"; do
    for c in nvfp4-lora bf16-lora-4bit-lr; do  # the same lr for both: bf16's control runs at the 4-bit lr
      for seed in 0 1; do
        OMP_NUM_THREADS=1 timeout "${2:-300}" python3 -m qerl_kit.experiments --grid full --configs "$c" --seeds $seed \
          --device cuda --model "$model" --dataset countdown --steps "${3:-150}" --eval-every 25 --lr "$lr" \
          --out "/tmp/cdsweep/lr$lr/$c-s$seed" > "/tmp/cdsweep/lr${lr}_$c-s$seed.log" 2>&1 &
      done
    done
  done
  wait
  python3 - <<'PY'
import pathlib
import pandas as pd
root = pathlib.Path("/tmp/cdsweep")
s = pd.concat([pd.read_csv(f) for f in sorted(root.glob("lr*/*/summary.csv"))])
m = pd.concat([pd.read_csv(f) for f in sorted(root.glob("lr*/*/metrics.csv"))])
ev = m.dropna(subset=["eval/accuracy"])
# the choice: NVFP4-LoRA's held-out accuracy averaged over its evaluations after the start (area under
# the curve: rewards learning early and staying there), mean over seeds; ties go to the smaller lr
auc = ev[ev.config == "nvfp4-lora"].groupby(["lr", "seed"])["eval/accuracy"].mean().groupby("lr").mean()
print(s.groupby(["config", "lr"])[["base_accuracy", "final_accuracy", "mean_reward", "final_reward",
                                   "mean_entropy"]].mean().round(3).to_string())
print("NVFP4 held-out accuracy, mean over evaluations:", auc.round(4).to_dict())
best = auc[auc == auc.max()].index.min()
print("best lr", best)
(pathlib.Path("/tmp/cd") / "best_lr").write_text(f"{best:g}")
PY
  tar -C /tmp -czf "$OUT/cdsweep.tgz" cdsweep
  ;;
engine32b)  # [VARIANTS]: default both; bf16 ran on 2026-12-02, NVFP4 on 2026-12-03 (same_day_h200_2026-12-0{2b,3}.md)
  read -r -a variants <<< "${2:-engine-bf16 engine-nvfp4}"
  timeout 330 python3 -m bench.bench_rollout --parts rollout --models Qwen2.5-32B --nvfp4-only --variants "${variants[@]}" \
    --batches 1 8 64 256 --n 8 --budget 230 --out "$OUT/r32" > /tmp/r32_log.txt 2>&1
  cp /tmp/r32_log.txt "$OUT/r32/stdout_log.txt"
  grep -v Warning /tmp/r32_log.txt | tail -14
  ;;
engine7b)  # ENGINE_TESTS=0 skips the kernel tests; BATCHES (default "1 8 64 256") picks the batches
  # the fused kernels compiled (CPU CI runs them in Triton's interpreter only)
  if [ "${ENGINE_TESTS:-1}" != 0 ]; then
    timeout 150 python3 -m pytest tests/test_engine_fused.py -q -x -p no:cacheprovider \
      > "$OUT/gpu_tests_log.txt" 2>&1; echo "engine-kernel tests rc=$?"; tail -3 "$OUT/gpu_tests_log.txt"
  fi
  read -r -a batches <<< "${BATCHES:-1 8 64 256}"
  timeout 360 python3 -m bench.bench_rollout --parts rollout --models Qwen2.5-7B --nvfp4-only \
    --variants engine-bf16 engine-nvfp4 \
    --batches "${batches[@]}" --n 8 --budget 300 --out "$OUT/r7" > /tmp/r7_log.txt 2>&1
  cp /tmp/r7_log.txt "$OUT/r7/stdout_log.txt"
  grep -v Warning /tmp/r7_log.txt | grep -E "ms/step|failed|Error" | tail -20
  ;;
live7b)
  python3 -m bench.bench_live_rows --models Qwen2.5-7B --formats nvfp4 bf16 --batches 64 256 --budget 220 \
    --out "$OUT/live" > "$OUT/live_log.txt" 2>&1
  tail -6 "$OUT/live_log.txt"
  ;;
vllm)
  fmt="${2:?format}"
  if [ "$fmt" = nf4 ] && [ -f .vllm/uns/slim.tgz ]; then  # an unpacked install folder that holds bitsandbytes
    tar -xzf .vllm/uns/slim.tgz -C /tmp && export PYTHONPATH="/tmp/slim:$PYTHONPATH"
  elif [ "$fmt" = nf4 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .vllm/bnb/*.whl && export PYTHONPATH="/tmp/bnb:$PYTHONPATH"
  fi
  timeout "${VLLM_TIMEOUT:-330}" python3 -m bench.bench_vllm_lengths --formats "$fmt" --budget 260 --out "$OUT/vllm" "${@:3}" \
    > "$OUT/vllm_${fmt}_log.txt" 2>&1
  grep -E "vLLM|Error|error|Maximum concurrency" "$OUT/vllm_${fmt}_log.txt" | tail -20
  ;;
grpo)
  fmt="${2:?format}"
  timeout 330 python3 -m bench.bench_grpo_engines --formats "$fmt" --out "$OUT/grpo" > "$OUT/grpo_${fmt}_log.txt" 2>&1
  grep -E "step #|adapter|failed|Error" "$OUT/grpo_${fmt}_log.txt" | tail -20
  ;;
nb05)  # notebook 05 (its rollout.engine: vllm cells too), after the vLLM exports; carry .whl with .whl/nb in it
  python3 -m bench.install_missing_wheels .whl/nb --target /tmp/nbsite && export PYTHONPATH="/tmp/nbsite:$PYTHONPATH"
  timeout "${NB_TIMEOUT:-500}" python3 scripts/execute_notebooks.py notebooks/05_gpu_real_model.ipynb --out "$OUT/nb05" \
    > "$OUT/nb05_log.txt" 2>&1; echo "notebook 05 rc=$?"; tail -20 "$OUT/nb05_log.txt"
  ;;
unsloth)
  tar -xzf .vllm/uns/slim.tgz -C /tmp && export PYTHONPATH="/tmp/slim:$PYTHONPATH"
  TMPDIR=/dev/shm timeout 420 python3 -m bench.probe_unsloth --out "$OUT/unsloth" --budget 330 > "$OUT/unsloth_log.txt" 2>&1
  grep "^\[probe\]" "$OUT/unsloth_log.txt" | tail -20
  ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac
ls -R "$OUT" | head -30
