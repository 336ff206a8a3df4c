#!/usr/bin/env bash
# bench/ac_cpu.sh — activation checkpointing, both sides of the trade, Titan
# and eager PyTorch (torch.utils.checkpoint, non-reentrant) side by side on
# the same model configs, threads and OpenBLAS kernels: tokens/s and peak
# memory with no checkpointing, every 2nd block, the per-op policy (Titan
# only: PyTorch 1.13 has none), and every block.
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
  for ac in none 2 op full; do
    local t p=""
    t="$("$TITAN" bench/train_cpu.lua "$1" "$2" "$3" "$STEPS" "$ac")"
    echo "$t"
    # PyTorch 1.13 has no per-op policy (create_selective_checkpoint_contexts arrived in 2.4): no peer for op
    if [ "$ac" != op ]; then
      p="$(/usr/bin/python3 bench/train_torch.py "$1" "$2" "$3" "$STEPS" "$ac")"
      echo "$p"
    fi
    local tt pt tm pm ta
    tt="$(field tps_best "$t")"; pt="$(field tps_best "$p")"
    tm="$(field maxrss_mib "$t")"; pm="$(field maxrss_mib "$p")"; ta="$(field alloc_peak_mib "$t")"
    if [ "$ac" = none ]; then base_t=$tt; base_p=$pt; base_tm=$tm; base_pm=$pm; base_ta=$ta; fi
    [ -n "$p" ] || { pt=0; pm=0; }
    awk -v c="$1" -v b="$2" -v s="$3" -v ac="$ac" -v tt="$tt" -v pt="$pt" -v tm="$tm" -v pm="$pm" -v ta="$ta" \
      -v bt="$base_t" -v bp="$base_p" -v btm="$base_tm" -v bpm="$base_pm" -v bta="$base_ta" 'BEGIN {
      ptxt = pt > 0 ? sprintf("%.0f (%.2fx)", pt, pt / bp) : "-"
      pmtxt = pm > 0 ? sprintf("%.0f (%.2fx)", pm, pm / bpm) : "-"
      printf "| %s | %dx%d | %s | %.0f (%.2fx) | %s | %.0f (%.2fx) | %.0f (%.2fx) | %s |\n",
        c, b, s, ac, tt, tt / bt, ptxt, ta, ta / bta, tm, tm / btm, pmtxt }' >>"$SUMMARY"
  done
}

bench debugmodel 4 1024
bench 125m 1 1024
echo
echo "ac: none, 2 (every 2nd block), op (per-op policy; no PyTorch 1.13 peer), full (every block);"
echo "(x) = against the same implementation's none"
echo
echo "| config | batch x seq | ac | titan tok/s | pytorch tok/s | titan alloc peak MiB | titan max RSS MiB |" \
  "pytorch max RSS MiB |"
echo "|---|---|---|---|---|---|---|---|"
cat "$SUMMARY"
rm -f "$SUMMARY"
