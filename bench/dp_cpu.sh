#!/usr/bin/env bash
# bench/dp_cpu.sh — data parallelism on the CPU, Titan and PyTorch side by
# side: the same global batch trained by one process with every core, and
# by 2 ranks with one core each (Titan: `titan --nproc 2`, DDP and FSDP over
# MPI; PyTorch: DistributedDataParallel over gloo — PyTorch's FSDP does not
# import with this machine's torch 1.13 on Python 3.11). Global tokens/s,
# best and median step after the first; the ratio DDP / one process says
# what the gradient exchange costs on top of the split, FSDP / DDP what
# gathering the parameters costs; and each Titan rank's memory after the
# last step (weights + optimizer state + data) and at its peak. A last
# Titan row splits the model instead (tensor parallelism, tp 2: both ranks
# train the whole global batch on half of every block), and the last three
# split its blocks into pipeline stages (pp 2 under 1F1B, GPipe and
# Interleaved1F1B: micro-batches of one row; PyTorch has no CPU pipeline
# over processes to compare with, so one Titan process is the reference).
#
#   bench/dp_cpu.sh [STEPS] [CONFIG] [GLOBAL_BATCH] [SEQ]   (defaults: 8 debugmodel 4 512)
#
# Titan runs its trainer on the debug recipe's data; PyTorch runs the plain
# Llama 3 of tests/reference on random tokens (bench/dp_torch.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS="${1:-8}" CFG="${2:-debugmodel}" GB="${3:-4}" SEQ="${4:-512}"
source bench/cpu_env.sh
CORES="$OMP_NUM_THREADS"

titan_run() { # nproc [fsdp|tp|pp SCHEDULE]
  local n="$1" mode="${2:-ddp}" dump extra=() layout=(--parallelism.dp_replicate="$1" --parallelism.dp_shard=1)
  local batch=$((GB / n))
  [ "$mode" = fsdp ] && layout=(--parallelism.dp_replicate=1 --parallelism.dp_shard="$n")
  # (the tp ranks read the same data: each has the whole batch, and the per-rank
  # tps counts a token once over the ranks, so x ranks is still the global rate)
  [ "$mode" = tp ] && layout=(--parallelism.tp="$n" --parallelism.dp_shard=1) && batch="$GB"
  [ "$mode" = pp ] && layout=(--parallelism.pp="$n" --parallelism.dp_shard=1
    --parallelism.pipeline_parallel_schedule="$3") && batch="$GB"
  dump="$(mktemp -d)"
  [ "$n" -gt 1 ] && extra=(--nproc "$n")
  [ "$CFG" = debugmodel ] || { echo "dp_cpu.sh: Titan's side runs the debugmodel recipe only" >&2; exit 1; }
  OMP_NUM_THREADS=$((CORES / n)) "$TITAN" "${extra[@]}" lua/recipes/llama3_debugmodel.lua \
    --job.dump_folder="$dump" --training.steps=$((STEPS + 1)) --training.local_batch_size="$batch" \
    --training.seq_len="$SEQ" --validation.enable=false --metrics.log_freq=1 --metrics.enable_jsonl=true \
    --metrics.peak_flops=1e11 "${layout[@]}" >/dev/null
  # (tps in metrics.jsonl is per rank: x ranks = global)
  /usr/bin/python3 - "$dump/metrics.jsonl" "$n" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and '"tps"' in l]
tps = [r["tps"] * int(sys.argv[2]) for r in recs][1:]  # (per rank x ranks; the first step includes the warm-up)
print(f"impl=titan world={sys.argv[2]} tps_best={max(tps):.1f} tps_median={statistics.median(tps):.1f} "
      f"mem_mib={recs[-1]['memory_gib'] * 1024:.1f} peak_mib={recs[-1]['memory_peak_gib'] * 1024:.1f}")
PY
  rm -rf "$dump"
}

torch_run() { # nproc
  local n="$1" port=$((29500 + RANDOM % 1000)) pids=() r
  for ((r = n - 1; r >= 0; r--)); do
    RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=$((CORES / n)) \
      /usr/bin/python3 bench/dp_torch.py "$CFG" $((GB / n)) "$SEQ" "$STEPS" &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r"; done
}

t1="$(titan_run 1)"; echo "$t1"
t2="$(titan_run 2)"; echo "$t2"
tf="$(titan_run 2 fsdp)"; echo "$tf (fsdp)"
tt="$(titan_run 2 tp)"; echo "$tt (tp)"
pp1="$(titan_run 2 pp 1F1B)"; echo "$pp1 (pp 1F1B)"
ppg="$(titan_run 2 pp GPipe)"; echo "$ppg (pp GPipe)"
ppi="$(titan_run 2 pp Interleaved1F1B)"; echo "$ppi (pp Interleaved1F1B)"
p1="$(torch_run 1)"; echo "$p1"
p2="$(torch_run 2)"; echo "$p2"
get() { sed -n "s/.*$2=\([0-9.]*\).*/\1/p" <<<"$1"; }
echo
echo "| config | global batch x seq | titan 1x$CORES tok/s | titan DDP 2x$((CORES / 2)) tok/s | titan FSDP 2x$((CORES / 2)) tok/s | titan DDP / 1 | titan FSDP / DDP | pytorch 1x$CORES tok/s | pytorch DDP 2x$((CORES / 2)) tok/s | pytorch DDP / 1 | titan DDP / pytorch DDP |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
awk -v c="$CFG" -v b="$GB" -v s="$SEQ" -v t1="$(get "$t1" tps_median)" -v t2="$(get "$t2" tps_median)" \
  -v tf="$(get "$tf" tps_median)" -v p1="$(get "$p1" tps_median)" -v p2="$(get "$p2" tps_median)" 'BEGIN {
  printf "| %s | %dx%d | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.0f | %.0f | %.2fx | %.2fx |\n", c, b, s, t1, t2, tf,
    t2 / t1, tf / t2, p1, p2, p2 / p1, t2 / p2 }'
echo "(median step after the first; best: titan $(get "$t1" tps_best) / $(get "$t2" tps_best) / $(get "$tf" tps_best), pytorch $(get "$p1" tps_best) / $(get "$p2" tps_best))"
echo "titan memory per rank after the last step (peak): one process $(get "$t1" mem_mib) MiB ($(get "$t1" peak_mib)), DDP $(get "$t2" mem_mib) MiB ($(get "$t2" peak_mib)), FSDP $(get "$tf" mem_mib) MiB ($(get "$tf" peak_mib)), TP $(get "$tt" mem_mib) MiB ($(get "$tt" peak_mib))"
awk -v t1="$(get "$t1" tps_median)" -v tt="$(get "$tt" tps_median)" 'BEGIN {
  printf "titan TP 2x'"$((CORES / 2))"': %.0f tok/s, %.2fx one process\n", tt, tt / t1 }'
for row in "1F1B:$pp1" "GPipe:$ppg" "Interleaved1F1B:$ppi"; do
  name="${row%%:*}" r="${row#*:}"
  awk -v n="$name" -v t1="$(get "$t1" tps_median)" -v tp="$(get "$r" tps_median)" -v m="$(get "$r" mem_mib)" \
    -v pk="$(get "$r" peak_mib)" 'BEGIN {
    printf "titan PP 2x'"$((CORES / 2))"' %s: %.0f tok/s, %.2fx one process; memory per rank %.1f MiB (peak %.1f)\n",
      n, tp, tp / t1, m, pk }'
done
