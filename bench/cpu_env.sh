# bench/cpu_env.sh — sourced by the CPU benchmarks that run Titan and PyTorch
# side by side: the same thread count and the same OpenBLAS kernels for both
# (the core type Titan chooses, which the library alone may not pick), a
# built titan, and a header line saying which.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
TITAN=./build/titan
[ -x "$TITAN" ] || ./titan --version >/dev/null
core="$("$TITAN" --version | sed -n 's/.*core=\([A-Za-z0-9]*\).*/\1/p')"
export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-$core}"
echo "threads=$OMP_NUM_THREADS OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE steps=$STEPS $(date -u +%FT%TZ)"
