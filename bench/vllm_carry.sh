#!/usr/bin/env bash
# Re-cut the vLLM payload that ../shared/tools/vllm-wheels-h200.sh leaves in .vllm/p1 .vllm/p2 .vllm/p3
# into pieces that fit one device call each, next to the repository's tracked files.
#
#   bash bench/vllm_carry.sh            # writes .vllm/q1 ... .vllm/qN; prints the N calls' commands
#
# Why: a call carries at most 64 MiB in all (tracked files + carried paths). The script's pieces
# are 51 MB each, and once the tracked files pass ~13 MB (17.4 MB on 2026-12-03) a piece
# and its neighbours no longer fit. The payload is cut into as many equal pieces as it needs
# (3 so far), named part_aa, part_ab, ... as install.sh expects, and install.sh goes with
# the last. The pieces' concatenation is checked against the original's sha256.
# Env: VLLM_DIR (default .vllm), CARRY_LIMIT (bytes, default 64 MiB), RESERVE (bytes left free
# for other carried paths such as .whl, default 2 MiB).
set -euo pipefail
dir="${VLLM_DIR:-.vllm}"
limit="${CARRY_LIMIT:-67108864}"
reserve="${RESERVE:-2097152}"
for p in p1 p2 p3; do
  [ -d "$dir/$p" ] || { echo "missing $dir/$p: run ../shared/tools/vllm-wheels-h200.sh first" >&2; exit 2; }
done
[ -f "$dir/p3/install.sh" ] || { echo "missing $dir/p3/install.sh" >&2; exit 2; }
tracked=$(git ls-files -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
room=$(( limit - tracked - reserve ))
[ "$room" -gt 0 ] || { echo "the tracked files ($tracked bytes) leave no room under CARRY_LIMIT=$limit" >&2; exit 2; }
total=$(cat "$dir"/p1/part_* "$dir"/p2/part_* "$dir"/p3/part_* | wc -c)
n=$(( (total + room - 1) / room ))
want=$(cat "$dir"/p1/part_* "$dir"/p2/part_* "$dir"/p3/part_* | sha256sum | cut -d' ' -f1)
# an earlier cut is replaced; a q folder holding anything else stops the script before it writes
for q in "$dir"/q[0-9]*; do
  [ -e "$q" ] || continue
  other=$(find "$q" -mindepth 1 ! -name 'part_*' ! -name install.sh | head -1)
  [ -z "$other" ] || { echo "$q holds files this script did not write ($other): not touched" >&2; exit 2; }
done
tmp=$(mktemp -d "$dir/.cut.XXXXXX")
cat "$dir"/p1/part_* "$dir"/p2/part_* "$dir"/p3/part_* | (cd "$tmp" && split -b $(( (total + n - 1) / n )) -a 2 - part_)
pieces=("$tmp"/part_*)
n=${#pieces[@]}
for q in "$dir"/q[0-9]*; do [ -e "$q" ] && rm -f "$q"/part_* "$q"/install.sh && rmdir "$q"; done
for i in $(seq 1 "$n"); do
  mkdir -p "$dir/q$i" && mv "${pieces[$((i - 1))]}" "$dir/q$i/"
done
cp "$dir/p3/install.sh" "$dir/q$n/"
rmdir "$tmp"
got=$(for i in $(seq 1 "$n"); do cat "$dir/q$i"/part_*; done | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "the pieces do not add up to the payload (sha256 $got, want $want)" >&2; exit 1; }
echo "$n pieces of <= $room bytes (tracked files $tracked bytes); sha256 $want"
for i in $(seq 1 "$n"); do
  first=""; [ "$i" = 1 ] && first="mkdir -p /tmp/vparts && "
  last=""; [ "$i" = "$n" ] && last=" && bash $dir/q$n/install.sh 2>/dev/null > /tmp/exports.sh && eval \"\$(tail -1 /tmp/exports.sh)\""
  echo "call $i: carry [\"$dir/q$i\", ...]: ${first}cp $dir/q$i/part_* /tmp/vparts/${last} && ..."
done
