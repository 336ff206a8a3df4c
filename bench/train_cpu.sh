#!/usr/bin/env bash
# bench/train_cpu.sh — Titan's trainer and eager PyTorch on the same model
# configs, the same thread count and the same BLAS settings, side by side:
# tokens/s, MFU (6·N + 12·L·H·Q·T FLOPs/token over the sgemm rate Titan
# measures at start) and peak memory (max RSS of each process).
#
#   bench/train_cpu.sh [STEPS]          (OMP_NUM_THREADS defaults to 2)
#
# PyTorch is Debian's python3-torch for /usr/bin/python3. Both processes get
# the OPENBLAS_CORETYPE Titan chooses, so both use the same OpenBLAS kernels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS="${1:-5}"
source bench/cpu_env.sh

run() { # config batch seq
  local t p
  t="$("$TITAN" bench/train_cpu.lua "$1" "$2" "$3" "$STEPS")"
  p="$(/usr/bin/python3 bench/train_torch.py "$1" "$2" "$3" "$STEPS")"
  echo "$t"
  echo "$p"
  local tt pt peak fpt tm pm
  tt="$(sed -n 's/.*tps_best=\([0-9.]*\).*/\1/p' <<<"$t")"
  pt="$(sed -n 's/.*tps_best=\([0-9.]*\).*/\1/p' <<<"$p")"
  peak="$(sed -n 's/.*peak_gflops=\([0-9.]*\).*/\1/p' <<<"$t")"
  fpt="$(sed -n 's/.*flops_per_token=\([0-9]*\).*/\1/p' <<<"$p")"
  tm="$(sed -n 's/.*maxrss_mib=\([0-9.]*\).*/\1/p' <<<"$t")"
  pm="$(sed -n 's/.*maxrss_mib=\([0-9.]*\).*/\1/p' <<<"$p")"
  awk -v c="$1" -v b="$2" -v s="$3" -v tt="$tt" -v pt="$pt" -v peak="$peak" -v fpt="$fpt" -v tm="$tm" -v pm="$pm" 'BEGIN {
    printf "| %s | %dx%d | %.0f | %.0f | %.2fx | %.1f%% | %.1f%% | %.0f | %.0f |\n",
      c, b, s, tt, pt, tt / pt, 100 * tt * fpt / (peak * 1e9), 100 * pt * fpt / (peak * 1e9), tm, pm }' >>"$SUMMARY"
}

SUMMARY="$(mktemp)"
run debugmodel 1 2048
run 125m 2 1024
echo
echo "| config | batch x seq | titan tok/s | pytorch tok/s | titan / pytorch | titan MFU | pytorch MFU | titan max RSS MiB | pytorch max RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
cat "$SUMMARY"
rm -f "$SUMMARY"
