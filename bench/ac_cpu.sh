#!/usr/bin/env bash
# bench/ac_cpu.sh — activation checkpointing, both sides of the trade, Titan
# and eager PyTorch (torch.utils.checkpoint, non-reentrant) side by side on
# the same model configs, threads and OpenBLAS kernels: tokens/s and peak
# memory with no checkpointing, every 2nd block, and every block.
#
#   bench/ac_cpu.sh [STEPS]          (OMP_NUM_THREADS defaults to 2)
#
# Each figure is relative to the same implementation's `none` run in this
# invocation (ratios, not absolute times: the machines are shared). Memory:
# max RSS of each process (both), and Titan's allocator peak (which leaves
# out the binary, the libraries and the allocator's cache).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS="${1:-3}"
source bench/cpu_env.sh

field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" <<<"$2"; }

SUMMARY="$(mktemp)"
bench() { # config batch seq
  local base_t base_p base_tm base_pm base_ta
  for ac in none 2 full; do
    local t p
    t="$("$TITAN" bench/train_cpu.lua "$1" "$2" "$3" "$STEPS" "$ac")"
    p="$(/usr/bin/python3 bench/train_torch.py "$1" "$2" "$3" "$STEPS" "$ac")"
    echo "$t"
    echo "$p"
    local tt pt tm pm ta
    tt="$(field tps_best "$t")"; pt="$(field tps_best "$p")"
    tm="$(field maxrss_mib "$t")"; pm="$(field maxrss_mib "$p")"; ta="$(field alloc_peak_mib "$t")"
    if [ "$ac" = none ]; then base_t=$tt; base_p=$pt; base_tm=$tm; base_pm=$pm; base_ta=$ta; fi
    awk -v c="$1" -v b="$2" -v s="$3" -v ac="$ac" -v tt="$tt" -v pt="$pt" -v tm="$tm" -v pm="$pm" -v ta="$ta" \
      -v bt="$base_t" -v bp="$base_p" -v btm="$base_tm" -v bpm="$base_pm" -v bta="$base_ta" 'BEGIN {
      printf "| %s | %dx%d | %s | %.0f (%.2fx) | %.0f (%.2fx) | %.0f (%.2fx) | %.0f (%.2fx) | %.0f (%.2fx) |\n",
        c, b, s, ac, tt, tt / bt, pt, pt / bp, ta, ta / bta, tm, tm / btm, pm, pm / bpm }' >>"$SUMMARY"
  done
}

bench debugmodel 4 1024
bench 125m 1 1024
echo
echo "ac: none, 2 (every 2nd block), full (every block); (x) = against the same implementation's none"
echo
echo "| config | batch x seq | ac | titan tok/s | pytorch tok/s | titan alloc peak MiB | titan max RSS MiB | pytorch max RSS MiB |"
echo "|---|---|---|---|---|---|---|---|"
cat "$SUMMARY"
rm -f "$SUMMARY"
