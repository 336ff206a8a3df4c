#!/usr/bin/env bash
# bench/ep_cpu.sh — expert parallelism on the CPU: debugmodel_moe trained by
# 2 ranks (one core each) with and without parallelism.expert_parallel_degree
# = 2, under FSDP and under DDP, the same global batch. No peer runs here:
# TorchTitan's expert parallelism needs a recent PyTorch on GPUs, and this
# machine's torch 1.13 has neither, so each EP row is compared with the same
# layout without EP in the same run (and the losses must agree). Global
# tokens/s (median step after the first), each rank's memory after the last
# step and at its peak, and the last step's loss.
#
#   bench/ep_cpu.sh [STEPS] [GLOBAL_BATCH] [SEQ]   (defaults: 8 4 256)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS="${1:-8}" GB="${2:-4}" SEQ="${3:-256}"
source bench/cpu_env.sh
CORES="$OMP_NUM_THREADS"

run() { # fsdp|ddp EP
  local layout=(--parallelism.dp_replicate=1 --parallelism.dp_shard=2) dump
  [ "$1" = ddp ] && layout=(--parallelism.dp_replicate=2 --parallelism.dp_shard=1)
  dump="$(mktemp -d)"
  OMP_NUM_THREADS=$((CORES / 2)) "$TITAN" --nproc 2 lua/recipes/llama3_debugmodel.lua \
    --model.flavor=debugmodel_moe --job.dump_folder="$dump" --training.steps=$((STEPS + 1)) \
    --training.local_batch_size=$((GB / 2)) --training.seq_len="$SEQ" --validation.enable=false \
    --metrics.log_freq=1 --metrics.enable_jsonl=true --metrics.peak_flops=1e11 \
    --parallelism.expert_parallel_degree="$2" "${layout[@]}" >/dev/null
  /usr/bin/python3 - "$dump/metrics.jsonl" "$1" "$2" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and '"tps"' in l]
tps = [r["tps"] * 2 for r in recs][1:]  # (per rank x 2 ranks; the first step includes the warm-up)
print(f"layout={sys.argv[2]} ep={sys.argv[3]} tps_median={statistics.median(tps):.1f} "
      f"mem_mib={recs[-1]['memory_gib'] * 1024:.1f} peak_mib={recs[-1]['memory_peak_gib'] * 1024:.1f} "
      f"loss={recs[-1]['loss']:.4f}")
PY
  rm -rf "$dump"
}

rows=()
for layout in fsdp ddp; do
  for ep in 1 2; do
    r="$(run "$layout" "$ep")"; echo "$r"; rows+=("$r")
  done
done
get() { sed -n "s/.*$2=\([0-9.]*\).*/\1/p" <<<"$1"; }
echo
echo "| layout, 2x$((CORES / 2)) | tok/s without EP | tok/s EP 2 | EP / without | MiB per rank without / EP" \
  "| peak MiB without / EP | loss without / EP |"
echo "|---|---|---|---|---|---|---|"
for i in 0 2; do
  a="${rows[$i]}" b="${rows[$((i + 1))]}"
  awk -v l="$(sed 's/layout=\([a-z]*\).*/\1/' <<<"$a")" -v ta="$(get "$a" tps_median)" -v tb="$(get "$b" tps_median)" \
    -v ma="$(get "$a" mem_mib)" -v mb="$(get "$b" mem_mib)" -v pa="$(get "$a" peak_mib)" -v pb="$(get "$b" peak_mib)" \
    -v la="$(get "$a" loss)" -v lb="$(get "$b" loss)" 'BEGIN {
    printf "| %s | %.0f | %.0f | %.2fx | %.0f / %.0f | %.0f / %.0f | %s / %s |\n", toupper(l), ta, tb, tb / ta, ma, mb,
      pa, pb, la, lb }'
done
