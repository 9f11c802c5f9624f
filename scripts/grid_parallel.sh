#!/usr/bin/env bash
# qerl_kit.experiments' grid with one process per configuration, all on one GPU, then one merge.
#
#   bash scripts/grid_parallel.sh OUT_DIR [GRID] [LIMIT_S] [extra experiments arguments ...]
#   bash scripts/grid_parallel.sh runs/experiments-gpu full 540 --device cuda
#
# Why: the tiny model's runs are bound by Python and kernel launches, not by the GPU, so seven
# processes sharing one GPU finish about as fast as one. Each process trains one configuration's
# seeds into OUT_DIR/parts/<config>/ (resumable: finished runs are read back on the next call);
# when every run has finished, their CSVs go to OUT_DIR/runs/ and one more
# `python -m qerl_kit.experiments --out OUT_DIR` (which then trains nothing) writes the merged
# metrics.csv, summary.csv, table.md, figures and command.json. LIMIT_S (0 = none) stops the
# processes after that many seconds; run the script again to continue. SEED_GROUPS (e.g. "0,1,2 3,4")
# splits each configuration's seeds over that many processes (OUT_DIR/parts/<config>-s<seeds>/), for
# machines with more cores than configurations (the groups should cover the grid's seeds, or those of
# a --seeds among the arguments, which the merge then reads); empty (the default): one process per
# configuration. GRID_CONFIGS (e.g. "bf16-lora nvfp4-lora") trains and merges only those of GRID's
# configurations (a longer run of a few); empty (the default): all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:?usage: grid_parallel.sh OUT_DIR [GRID] [LIMIT_S] [args ...]}"
GRID="${2:-full}"
LIMIT="${3:-0}"
shift $(( $# < 3 ? $# : 3 ))
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
CONFIGS="${GRID_CONFIGS:-}"
[ -n "$CONFIGS" ] || CONFIGS=$("$PY" -c "from qerl_kit.experiments import GRIDS; print(' '.join(GRIDS['$GRID'][0]))") || exit 1
mkdir -p "$OUT_DIR/parts" "$OUT_DIR/runs"
read -r -a groups <<< "${SEED_GROUPS:-}"
pids=()
for c in $CONFIGS; do
  if [ "$LIMIT" -gt 0 ]; then t=(timeout "$LIMIT"); else t=(); fi
  for g in "${groups[@]:-all}"; do
    if [ "$g" = all ]; then name="$c"; seeds=(); else name="$c-s${g//,/_}"; seeds=(--seeds ${g//,/ }); fi
    "${t[@]}" "$PY" -m qerl_kit.experiments --grid "$GRID" --configs "$c" --out "$OUT_DIR/parts/$name" "$@" "${seeds[@]}" \
      >> "$OUT_DIR/parts/$name.log" 2>&1 &
    pids+=("$!")
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done  # 0 only once all its runs finished
cp "$OUT_DIR"/parts/*/runs/*.csv "$OUT_DIR/runs/" 2>/dev/null
echo "finished runs: $(ls "$OUT_DIR"/runs/*_summary.csv 2>/dev/null | wc -l); configurations not finished: $failed"
tail -n 2 "$OUT_DIR"/parts/*.log
if [ "$failed" -gt 0 ]; then
  echo "not all runs finished (stopped by LIMIT_S or failed, see OUT_DIR/parts/*.log): run this again to continue" >&2
  exit 3
fi
"$PY" -m qerl_kit.experiments --grid "$GRID" --configs $CONFIGS --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/merge.log"
