#!/usr/bin/env bash
# gpu_check.sh — the GPU check (docs/gpu.md): build Titan with CUDA on a lent
# GPU machine that has CUDA, CMake, a C compiler and PyTorch but no network
# and none of LuaJIT, lua-cjson, busted, OpenBLAS; run the CUDA tests and the
# GPU benchmarks; write a summary. Three modes:
#
#   scripts/gpu_check.sh --prepare   here, with Debian's registry: download the
#                                    .debs the GPU machine lacks into .gpu/debs/
#                                    (git-ignored), then self-test an unpacked copy
#   scripts/gpu_check.sh --dry-run   here: print the steps, the environment, the
#                                    commands and what travels; runs nothing
#   scripts/gpu_check.sh OUTDIR      on the GPU machine (no network): unpack the
#                                    .debs into .gpu/prefix, configure + build
#                                    build-gpu/ with TITAN_CUDA=ON, run the CUDA
#                                    tests, the benchmarks, then the C/Lua suite
#                                    if time is left; OUTDIR/summary.md + logs
#
# The run fits one 10-minute command: every step has its own timeout, cut to
# what is left of GPU_CHECK_BUDGET; a failed step does not stop the next one;
# summary.md is rewritten after every step, so it exists even if the whole
# command is killed. OUTDIR receives exactly 8 files (the device tool brings
# back at most 8). Nothing here changes the GPU's settings.
#
# Settings (environment):
#   GPU_CHECK_BUDGET=530     seconds for the whole run (the tool's limit is 600)
#   GPU_CHECK_STEPS=...      comma list of steps to run (default: all, in order):
#                            probe,unpack,configure,build,cuda_tests,bench_titan,bench_torch,cpu_tests
#   GPU_CHECK_WERROR=0       1: keep -Werror (CI enforces warnings; here a warning
#                            must not cost the run)
#   GPU_CHECK_JOBS=nproc     build and ctest parallelism
#   GPU_CHECK_QUICK=0        1: benchmarks take their short paths (fewer shapes)
#   GPU_CHECK_CUDA_TESTS=^cuda/  the ctest regex of the CUDA specs to run
#   GPU_CHECK_BENCH_ONLY=    sections of bench/gpu.lua to run (its --only: a comma
#                            list of gemm,attention,memory,train; default all)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The machine's own library path (its driver may be found only through it),
# before the prefix is put in front: what PyTorch runs with.
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH-}"
GPU_DIR="$ROOT/.gpu"
DEBS="$GPU_DIR/debs"
PREFIX="$GPU_DIR/prefix"
FALLBACK="$GPU_DIR/fallback"     # libs used only when the machine has none of its own
EXTRA_LIBS="$GPU_DIR/extra-libs" # symlinks to the fallback libs actually missing there
SCRATCH="$GPU_DIR/run"           # intermediate results of a run (JSON)
BUILD="$ROOT/build-gpu"
MULTIARCH="x86_64-linux-gnu"
LIMIT_MIB=64                     # what the device tool carries, working tree included
BUDGET="${GPU_CHECK_BUDGET:-530}"
JOBS="${GPU_CHECK_JOBS:-$(nproc 2>/dev/null || echo 8)}"

# The Debian 12 packages the GPU machine lacks. Only what is needed at run
# time (and the headers + .pc files the build needs):
#   LuaJIT (interpreter, library, jit.* modules, headers + luajit.pc)
#   lua-cjson; busted and what it requires at run time (lua-cliargs' optional
#     lua-inifile / lua-yaml are required lazily, for config files: not needed)
#   OpenBLAS, OpenMP build (Titan dlopens libopenblas.so.0: TITAN_BLAS points at
#     it; the libopenblas0 metapackage only selects an alternative: not needed)
#     + libgfortran5/libquadmath0 it links (+ libgomp1), used only when the
#     machine has none of its own (a newer libgomp must not be shadowed)
#   PCRE2 (library, header, libpcre2-8.pc); pkgconf, in case the machine has no
#     pkg-config (CMake's pkg_check_modules needs one)
#   the fortunes corpus (the C/Lua suite's training tests read it)
PACKAGES=(
  luajit libluajit-5.1-2 libluajit-5.1-common libluajit-5.1-dev
  lua-cjson
  lua-busted lua-cliargs lua-dkjson lua-filesystem lua-luassert lua-mediator lua-penlight lua-say lua-system lua-term
  libopenblas0-openmp libgfortran5 libquadmath0 libgomp1
  libpcre2-8-0 libpcre2-dev
  pkgconf pkgconf-bin libpkgconf3
  fortunes fortunes-min
)
FALLBACK_PACKAGES="libgfortran5 libquadmath0 libgomp1"
FALLBACK_SONAMES="libgfortran.so.5 libquadmath.so.0 libgomp.so.1"
STEPS_ALL="probe unpack configure build cuda_tests bench_titan bench_torch cpu_tests"

say() { printf 'gpu_check: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# ---- what travels ----------------------------------------------------------

debs_bytes() { du -cb "$DEBS"/*.deb 2>/dev/null | awk 'END { print $1 + 0 }'; }

# The working tree that travels: tracked + untracked files that are not
# ignored. Estimated without git: the tree minus the ignored folders we know.
tree_bytes() {
  (cd "$ROOT" && du -sb --exclude=./.git --exclude=./build --exclude='./build-*' --exclude=./.gpu --exclude=./tmp \
    --exclude='*.o' --exclude='*.so' . 2>/dev/null) | awk '{ print $1 + 0 }'
}

list_debs() {
  local f
  for f in "$DEBS"/*.deb; do
    [ -e "$f" ] || continue
    printf '    %-58s %8s KiB\n' "$(basename "$f")" "$(( ($(stat -c %s "$f") + 1023) / 1024 ))"
  done
}

# ---- unpack + environment (shared by the run, the dry run and the self-test)

extract_deb() { # deb dest
  if command -v dpkg-deb >/dev/null 2>&1; then
    dpkg-deb -x "$1" "$2"
    return
  fi
  # No dpkg: a .deb is an ar archive holding data.tar.*.
  local tmp member
  tmp="$(mktemp -d)"
  member="$(cd "$tmp" && ar t "$1" | grep '^data\.tar' | head -n 1)"
  (cd "$tmp" && ar x "$1" "$member") && tar -xf "$tmp/$member" -C "$2"
  local rc=$?
  rm -rf "$tmp"
  return $rc
}

is_fallback_pkg() { local p="${1%%_*}" x; for x in $FALLBACK_PACKAGES; do [ "$p" = "$x" ] && return 0; done; return 1; }

debs_stamp() { (cd "$DEBS" && ls -l --time-style=+%s ./*.deb 2>/dev/null | awk '{ print $5, $6, $7 }' | md5sum | cut -c1-32); }

# unpack_prefix PREFIX FALLBACK: every .deb into PREFIX (the fallback libs
# into FALLBACK), .pc files pointed at the prefix. A no-op when the same
# .debs were unpacked there before (a warm machine keeps ignored folders).
unpack_prefix() {
  local prefix="$1" fallback="$2" stamp
  stamp="$(debs_stamp)"
  if [ -f "$prefix/.stamp" ] && [ "$(cat "$prefix/.stamp")" = "$stamp" ]; then
    echo "prefix $prefix is up to date (same .debs): not unpacked again"
    return 0
  fi
  rm -rf "$prefix" "$fallback"
  mkdir -p "$prefix" "$fallback"
  local f n=0
  for f in "$DEBS"/*.deb; do
    [ -e "$f" ] || { echo "no .deb in $DEBS: run scripts/gpu_check.sh --prepare first (and carry .gpu/debs)"; return 1; }
    if is_fallback_pkg "$(basename "$f")"; then
      extract_deb "$f" "$fallback" || { echo "cannot unpack $f"; return 1; }
    else
      extract_deb "$f" "$prefix" || { echo "cannot unpack $f"; return 1; }
    fi
    n=$((n + 1))
  done
  # pkg-config files say prefix=/usr: point them at the prefix.
  local pc
  for pc in "$prefix"/usr/lib/$MULTIARCH/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
    [ -e "$pc" ] || continue
    sed -i -E "s#^(prefix|exec_prefix|libdir|includedir|sharedlibdir)=/usr#\\1=$prefix/usr#" "$pc"
  done
  echo "$stamp" >"$prefix/.stamp"
  echo "unpacked $n .debs into $prefix (fallback libs into $fallback)"
}

system_has_lib() { # soname: does the machine itself have it (not our prefix)?
  local d
  if command -v ldconfig >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q " $1 "; then return 0; fi
  for d in /lib/$MULTIARCH /usr/lib/$MULTIARCH /lib64 /usr/lib64 /usr/local/lib; do
    [ -e "$d/$1" ] && return 0
  done
  return 1
}

# link_missing_fallbacks FALLBACK EXTRA: symlink the fallback libs the
# machine lacks into EXTRA (which goes on LD_LIBRARY_PATH).
link_missing_fallbacks() {
  local fallback="$1" extra="$2" so
  rm -rf "$extra"
  mkdir -p "$extra"
  for so in $FALLBACK_SONAMES; do
    if system_has_lib "$so"; then
      echo "  $so: the machine's own"
    elif [ -e "$fallback/usr/lib/$MULTIARCH/$so" ]; then
      ln -sf "$fallback/usr/lib/$MULTIARCH/$so" "$extra/$so"
      echo "  $so: carried copy ($fallback/usr/lib/$MULTIARCH/$so)"
    else
      echo "  $so: MISSING (neither the machine nor .gpu/debs has it)"
    fi
  done
}

# prefix_env PREFIX EXTRA: print the export lines of the environment that
# makes the prefix usable (eval'ed by the run, printed by the dry run).
prefix_env() {
  local p="$1/usr" extra="$2" lib="$1/usr/lib/$MULTIARCH"
  cat <<EOF
export PATH="$p/bin:\$PATH"
export LD_LIBRARY_PATH="$lib:$extra\${CUDA_EXTRA_LIBDIRS:+:\$CUDA_EXTRA_LIBDIRS}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LUA_PATH="$p/share/lua/5.1/?.lua;$p/share/lua/5.1/?/init.lua;$p/share/luajit-2.1.0-beta3/?.lua"
export LUA_CPATH="$lib/lua/5.1/?.so"
export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$p/share/pkgconfig"
unset PKG_CONFIG_PATH
export TITAN_BLAS="$lib/openblas-openmp/libopenblas.so.0"
export CMAKE_PREFIX_PATH="$p\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}"
EOF
}

# ---- the self-test of an unpacked prefix (run by --prepare) ----------------

# With a minimal PATH and Lua paths that name only the prefix (no ';;', so
# the system's /usr/share/lua is never searched), every lookup must resolve
# inside the prefix.
selftest_prefix() {
  local scratch prefix fallback extra
  scratch="$(mktemp -d /tmp/gpu_check_selftest.XXXXXX)"
  prefix="$scratch/prefix" fallback="$scratch/fallback" extra="$scratch/extra-libs"
  echo "self-test: unpacking into $scratch"
  unpack_prefix "$prefix" "$fallback" >/dev/null || { echo "self-test: unpack FAILED"; return 1; }
  link_missing_fallbacks "$fallback" "$extra" >/dev/null
  # The Lua side: each module must load, and from the prefix.
  cat >"$scratch/check.lua" <<'LUA'
local prefix = arg[1]
local fail = 0
local function check(what, value)
  value = tostring(value)
  if value:sub(1, #prefix + 1) == prefix .. "/" then
    print(("  ok    %-26s %s"):format(what, value))
  else
    print(("  FAIL  %-26s %s (not in the prefix)"):format(what, value))
    fail = 1
  end
end
local maps = io.open("/proc/self/maps"):read("*a")
check("luajit running", maps:match("(/%S*luajit%S*)") or "?")
for _, m in ipairs({ "cjson", "lfs", "busted.runner", "luassert", "say", "pl.path", "term", "system", "cliargs",
  "mediator", "dkjson" }) do
  local ok, err = pcall(require, m)
  if not ok then
    check('require "' .. m .. '"', "ERROR: " .. tostring(err):gsub("\n", " "))
  else
    check('require "' .. m .. '"', package.searchpath(m, package.path) or package.searchpath(m, package.cpath)
      or package.searchpath(m:match("^[^.]+") .. ".core", package.cpath) or "?")
  end
end
os.exit(fail)
LUA
  local out rc
  out="$(
    env -i HOME="$scratch" PATH="/usr/bin:/bin" bash -c '
      set -u
      eval "$1"
      prefix="$2"; fail=0
      check() { # what value
        case "$2" in "$prefix"/*) printf "  ok    %-26s %s\n" "$1" "$2";;
          *) printf "  FAIL  %-26s %s (not in the prefix)\n" "$1" "$2"; fail=1;; esac; }
      check "luajit" "$(command -v luajit)"
      check "pkg-config" "$(command -v pkg-config)"
      luajit "$3" "$prefix" || fail=1
      check "pkg-config luajit -I" "$(pkg-config --cflags-only-I luajit | sed "s/^-I//; s/ *$//")"
      check "pkg-config luajit -L" "$(pkg-config --libs-only-L luajit | sed "s/^-L//; s/ *$//")"
      check "pkg-config libpcre2-8 -L" "$(pkg-config --libs-only-L libpcre2-8 | sed "s/^-L//; s/ *$//")"
      check "pcre2.h" "$(pkg-config --variable=includedir libpcre2-8)/pcre2.h"
      [ -e "$(pkg-config --variable=includedir libpcre2-8)/pcre2.h" ] || { echo "  FAIL  pcre2.h missing"; fail=1; }
      [ -e "$(pkg-config --variable=includedir luajit)/lua.h" ] || { echo "  FAIL  luajit lua.h missing"; fail=1; }
      check "TITAN_BLAS" "$TITAN_BLAS"
      [ -e "$TITAN_BLAS" ] || { echo "  FAIL  $TITAN_BLAS missing"; fail=1; }
      check "fortunes corpus" "$(ls -d "$prefix"/usr/share/games/fortunes/fortunes)"
      echo "  corpus files: $(ls "$prefix"/usr/share/games/fortunes | grep -vc "\.\(dat\|u8\)$")"
      exit $fail
    ' _ "$(prefix_env "$prefix" "$extra")" "$prefix" "$scratch/check.lua" 2>&1
  )"
  rc=$?
  echo "$out"
  rm -rf "$scratch"
  if [ $rc -eq 0 ]; then echo "self-test: every lookup resolved inside the unpacked prefix"; else echo "self-test: FAILED"; fi
  return $rc
}

# ---- --prepare ----------------------------------------------------------------

prepare() {
  command -v apt-get >/dev/null 2>&1 || die "--prepare needs apt-get (Debian 12, as on the development machines)"
  mkdir -p "$DEBS"
  rm -f "$DEBS"/*.deb
  say "downloading ${#PACKAGES[@]} Debian packages into .gpu/debs/"
  if ! (cd "$DEBS" && apt-get download -q "${PACKAGES[@]}" >/dev/null 2>"$GPU_DIR/apt.log"); then
    say "apt-get download failed; running apt-get update once and retrying"
    apt-get update -qq >/dev/null 2>&1 || true
    rm -f "$DEBS"/*.deb
    (cd "$DEBS" && apt-get download -q "${PACKAGES[@]}" >/dev/null 2>"$GPU_DIR/apt.log") ||
      { cat "$GPU_DIR/apt.log" >&2; die "apt-get download failed (log: .gpu/apt.log)"; }
  fi
  chmod 644 "$DEBS"/*.deb
  local total tree
  total="$(debs_bytes)"
  tree="$(tree_bytes)"
  (cd "$DEBS" && for f in *.deb; do printf '%s %s\n' "$(md5sum "$f" | cut -c1-32)" "$f"; done) >"$DEBS/MANIFEST"
  echo "packages in .gpu/debs/:"
  list_debs
  echo "total: $(ls "$DEBS"/*.deb | wc -l) .debs, $(mib "$total") MiB; working tree (estimate) $(mib "$tree") MiB;" \
    "together $(mib $((total + tree))) MiB of the device tool's $LIMIT_MIB MiB"
  if [ $((total + tree)) -gt $((48 * 1048576)) ]; then
    say "WARNING: over 48 MiB together: too close to the $LIMIT_MIB MiB the device tool carries"
  fi
  selftest_prefix || die "the unpacked prefix does not work on its own (see above)"
  echo "next: scripts/gpu_check.sh --dry-run; on the GPU machine: scripts/gpu_check.sh \$OUT (carry .gpu/debs)"
}

# ---- the steps ----------------------------------------------------------------

# Upper bound of each step, in seconds (cut to what is left of the budget).
step_timeout() {
  case "$1" in
    probe) echo 30 ;; unpack) echo 90 ;; configure) echo 150 ;; build) echo 330 ;;
    cuda_tests) echo 200 ;; bench_titan) echo 220 ;; bench_torch) echo 150 ;; cpu_tests) echo 400 ;;
  esac
}
step_log() {
  case "$1" in
    probe | unpack | configure) echo setup.log ;; build) echo build.log ;; cuda_tests) echo cuda_tests.log ;;
    bench_titan) echo bench_titan.log ;; bench_torch) echo bench_torch.log ;; cpu_tests) echo cpu_tests.log ;;
  esac
}
step_about() {
  case "$1" in
    probe) echo "what the machine has: GPU, driver, nvcc, cmake, compilers, Python + torch, pkg-config, dpkg, where cuBLASLt/cuDNN/NCCL live (read-only queries)" ;;
    unpack) echo "unpack .gpu/debs/*.deb (dpkg-deb -x, or ar + tar) into .gpu/prefix (libgomp1/libgfortran5/libquadmath0 into .gpu/fallback, linked into .gpu/extra-libs only where the machine lacks them); point the .pc files at the prefix" ;;
    configure) echo "cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTITAN_CUEMU=OFF -DTITAN_CUDA=ON -DTITAN_NVCC_THREADS=4 -DTITAN_WERROR=OFF -DPKG_CONFIG_EXECUTABLE=<pkg-config on PATH> [-DTITAN_NVCC=/-DCMAKE_CUDA_COMPILER=<nvcc>] [-DTITAN_CUDNN_LIBRARY=/-DTITAN_CUDNN_INCLUDE=/-DTITAN_NCCL_LIBRARY=/-DTITAN_NCCL_INCLUDE=/-DCUDA_cublasLt_LIBRARY=/-DCUDA_cublas_LIBRARY= where found outside the toolkit's own folders]" ;;
    build) echo "cmake --build build-gpu -j $JOBS (GPU_CHECK_JOBS, default nproc) [-- -k with make]" ;;
    cuda_tests) echo "cd build-gpu && NCCL_SOCKET_IFNAME=lo OMP_NUM_THREADS=2 ctest -R '^cuda/' -j 10 --output-on-failure (tests/cuda/*_spec.lua under busted inside build-gpu/titan, all at once; /usr/share/games/fortunes -> the carried corpus when the machine has none)" ;;
    bench_titan) echo "build-gpu/titan bench/gpu.lua --json .gpu/run/titan.json --budget <step time - 10> [--quick] [--only \$GPU_CHECK_BENCH_ONLY]" ;;
    bench_torch) echo "python3 bench/gpu_torch.py --json .gpu/run/torch.json --titan-json .gpu/run/titan.json --budget <step time - 10> (with the machine's own LD_LIBRARY_PATH, not the prefix's)" ;;
    cpu_tests) echo "cd build-gpu && OMP_NUM_THREADS=<jobs/4> ctest -E '^cuda/' -j 4 --output-on-failure (the C and Lua suite; /usr/share/games/fortunes -> the carried corpus when the machine has none; TITAN_REFERENCE_PYTHON/TITAN_HF_PYTHON = python3 with torch)" ;;
  esac
}

probe_cmd() {
  echo "== date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -srm)"
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>&1 | head -n 5
  nvidia-smi -L 2>&1 | head -n 4
  echo "== tools"
  local t
  for t in nvcc cmake ninja make gcc cc g++ python3 pkg-config pkgconf dpkg-deb ar ldconfig timeout; do
    printf '  %-10s %s\n' "$t" "$(command -v "$t" 2>/dev/null || echo '-')"
  done
  [ -x /usr/local/cuda/bin/nvcc ] && echo "  /usr/local/cuda/bin/nvcc exists"
  (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -n 2
  cmake --version 2>/dev/null | head -n 1
  gcc --version 2>/dev/null | head -n 1
  echo "== python"
  python3 -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -n 1
  echo "== CUDA libraries"
  find_cuda_libs
  echo "CUDA_CMAKE_ARGS=${CUDA_CMAKE_ARGS:-}"
  echo "CUDA_EXTRA_LIBDIRS=${CUDA_EXTRA_LIBDIRS:-}"
  echo "== os"
  head -n 2 /etc/os-release 2>/dev/null
  ldd --version 2>/dev/null | head -n 1
  echo "cpus: $(nproc)  memory: $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
}

first_match() { # pattern dirs... -> first existing file
  local pat="$1" d f
  shift
  for d in "$@"; do
    [ -d "$d" ] || continue
    for f in "$d"/$pat; do [ -e "$f" ] && { echo "$f"; return 0; }; done
  done
  return 1
}

sibling_header() { # library header -> that header as installed with the library
  local d
  d="$(dirname "$1")"
  case "$d" in
    "/usr/lib/$MULTIARCH" | "/lib/$MULTIARCH" | /usr/lib64 | /usr/lib | /lib64)
      first_match "$2" /usr/include "/usr/include/$MULTIARCH" ;;
    /usr/local/lib | /usr/local/lib64) first_match "$2" /usr/local/include ;;
    *)
      local inc_dir
      inc_dir="$(cd "$d/../include" 2>/dev/null && pwd)" && first_match "$2" "$inc_dir" ;;
  esac
}

# The functions find_cuda_libs calls: a step that runs in a fresh shell
# (bash -c) takes them all (a missing one showed on the GPU machine only, as
# "sibling_header: command not found" and every library "not one install").
CUDA_HELPERS="find_cuda_libs first_match sibling_header"

# Where nvcc, cuBLASLt, cuDNN and NCCL are. CMake finds them in the toolkit's
# folders by itself; when they exist only elsewhere (e.g. PyTorch's nvidia-*
# wheels), their paths go to CMake (CUDA_CMAKE_ARGS) and their folders onto
# LD_LIBRARY_PATH (CUDA_EXTRA_LIBDIRS).
find_cuda_libs() {
  CUDA_CMAKE_ARGS="" CUDA_EXTRA_LIBDIRS=""
  local nvcc cuda_root wheel_dirs=() lib inc name
  nvcc="$(command -v nvcc 2>/dev/null || true)"
  [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
  [ -z "$nvcc" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] && nvcc="$CUDA_HOME/bin/nvcc"
  if [ -z "$nvcc" ]; then
    echo "  nvcc: NOT FOUND (the configure step will build without CUDA and the CUDA tests will skip)"
    return 0
  fi
  echo "  nvcc: $nvcc"
  CUDA_CMAKE_ARGS+=" -DTITAN_NVCC=$nvcc -DCMAKE_CUDA_COMPILER=$nvcc"
  cuda_root="$(cd "$(dirname "$nvcc")/.." && pwd -P)"
  # (the system folders: GPU_CHECK_SYSTEM_LIBDIRS / _INCDIRS override them, so that
  # tests/lua/gpu_check_spec.lua's stand-in installs are not outvoted by a real
  # cuDNN on the machine running it)
  local sys_libs=() sys_incs=()
  read -r -a sys_libs <<<"${GPU_CHECK_SYSTEM_LIBDIRS-/usr/lib/$MULTIARCH /usr/lib64 /usr/local/lib}"
  read -r -a sys_incs <<<"${GPU_CHECK_SYSTEM_INCDIRS-/usr/include /usr/local/include}"
  local tk_libs=("$cuda_root/lib64" "$cuda_root/lib" "$cuda_root/targets/x86_64-linux/lib" "${sys_libs[@]}")
  local tk_incs=("$cuda_root/include" "$cuda_root/targets/x86_64-linux/include" "${sys_incs[@]}")
  local site
  site="$(python3 -c 'import nvidia, os; print("\n".join(os.path.realpath(p) for p in nvidia.__path__))' 2>/dev/null || true)"
  while IFS= read -r d; do [ -n "$d" ] && wheel_dirs+=("$d"); done <<<"$site"
  for name in cudnn nccl cublasLt; do
    local hdr="$name.h"
    [ "$name" = cublasLt ] && hdr="cublasLt.h"
    # Each library found, toolkit and system folders first, then the wheels;
    # the first one whose own install has the header wins (a header from
    # one cuDNN and a library from another compile and then fail at run
    # time, or worse). Only when none has one are the two taken apart.
    local cands=() d w sub c h
    for d in "${tk_libs[@]}"; do
      c="$(first_match "lib$name.so" "$d" || first_match "lib$name.so.*" "$d" || true)"
      [ -n "$c" ] && cands+=("$c|toolkit/system")
    done
    for w in "${wheel_dirs[@]}"; do
      for sub in "$w"/*/; do
        c="$(first_match "lib$name.so*" "${sub}lib" || true)"
        [ -n "$c" ] && cands+=("$c|wheel")
      done
    done
    lib="" inc=""
    local where=""
    for c in "${cands[@]}"; do
      h="$(sibling_header "${c%%|*}" "$hdr" || true)"
      if [ -n "$h" ]; then
        lib="${c%%|*}" inc="$h" where="${c##*|}"
        break
      fi
    done
    if [ -z "$lib" ]; then
      [ "${#cands[@]}" -gt 0 ] && lib="${cands[0]%%|*}"
      inc="$(first_match "$hdr" "${tk_incs[@]}" || true)"
      for w in "${wheel_dirs[@]}"; do
        for sub in "$w"/*/; do [ -z "$inc" ] && inc="$(first_match "$hdr" "${sub}include" || true)"; done
      done
      where="not one install: the header and the library come from different places; check that their versions agree"
    fi
    printf '  %-9s lib %s\n            header %s  [%s]\n' "$name" "${lib:-NOT FOUND}" "${inc:-NOT FOUND}" "$where"
    [ -n "$lib" ] || continue
    case "$lib" in
      "$cuda_root"/*) ;;
      *) case "$(dirname "$lib")" in "/usr/lib/$MULTIARCH" | /usr/lib64 | "/lib/$MULTIARCH") ;;
           *) CUDA_EXTRA_LIBDIRS="${CUDA_EXTRA_LIBDIRS:+$CUDA_EXTRA_LIBDIRS:}$(dirname "$lib")" ;; esac ;;
    esac
    case "$name" in
      cudnn | nccl)
        local up
        up="$(echo "$name" | tr a-z A-Z)"
        CUDA_CMAKE_ARGS+=" -DTITAN_${up}_LIBRARY=$lib"
        [ -n "$inc" ] && CUDA_CMAKE_ARGS+=" -DTITAN_${up}_INCLUDE=$(dirname "$inc")"
        ;;
      cublasLt)
        # FindCUDAToolkit looks in the toolkit only; name it when it is elsewhere (cuBLAS, which
        # the GEMM's TITAN_CUDA_GEMM_API=cublas uses, comes in the same folder: one package).
        case "$lib" in
          "$cuda_root"/*) ;;
          *) CUDA_CMAKE_ARGS+=" -DCUDA_cublasLt_LIBRARY=$lib"
             local blas
             blas="$(first_match "libcublas.so" "$(dirname "$lib")" || first_match "libcublas.so.*" "$(dirname "$lib")" \
               || true)"
             [ -n "$blas" ] && CUDA_CMAKE_ARGS+=" -DCUDA_cublas_LIBRARY=$blas" ;;
        esac ;;
    esac
  done
  export CUDA_CMAKE_ARGS CUDA_EXTRA_LIBDIRS
}

configure_cmd() {
  local pc werror=OFF
  pc="$(command -v pkg-config || command -v pkgconf || true)"
  [ "${GPU_CHECK_WERROR:-0}" = "1" ] && werror=ON
  # cuemu (the CPU emulation of the CUDA backend) is for machines without a
  # GPU: not built here, where build time is GPU time.
  local args=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "-DTITAN_WERROR=$werror" -DTITAN_CUEMU=OFF)
  [ -n "$pc" ] && args+=(-DPKG_CONFIG_EXECUTABLE="$pc")
  if [ -n "$(echo "${CUDA_CMAKE_ARGS:-}" | grep -o TITAN_NVCC)" ]; then
    args+=(-DTITAN_CUDA=ON -DTITAN_NVCC_THREADS=4)
  else
    args+=(-DTITAN_CUDA=OFF)
  fi
  # shellcheck disable=SC2206
  args+=(${CUDA_CMAKE_ARGS:-})
  echo "+ cmake ${args[*]}"
  cmake "${args[@]}" || return $?
  grep -E '^(LUAJIT_(INCLUDE_DIRS|LDFLAGS)|PCRE2_(INCLUDE_DIRS|LDFLAGS)|TITAN_CUDA|TITAN_CUDNN_LIBRARY|TITAN_NCCL_LIBRARY|CUDA_cublasLt_LIBRARY|CMAKE_CUDA_COMPILER|CMAKE_GENERATOR):' \
    "$BUILD/CMakeCache.txt" | sed 's/^/  cache: /'
}

build_cmd() {
  local extra=()
  grep -q '^CMAKE_GENERATOR:INTERNAL=Unix Makefiles' "$BUILD/CMakeCache.txt" 2>/dev/null && extra=(-- -k)
  echo "+ cmake --build $BUILD -j $JOBS ${extra[*]}"
  cmake --build "$BUILD" -j "$JOBS" "${extra[@]}"
}

cuda_tests_cmd() {
  [ -x "$BUILD/titan" ] || { echo "no $BUILD/titan: the build failed"; return 1; }
  link_corpus
  # Without a device Titan can use, every spec would exit 77 (skipped) and
  # the step would read "ok": say why (the runtime's own error) and fail.
  "$BUILD/titan" -e '
    local t = require("titan")
    print("titan " .. t.version() .. " | cuda available: " .. tostring(t.cuda_available()) .. ", devices: "
      .. t.cuda_device_count() .. " | " .. t.blas_info())
    if t.cuda_available() then
      local free, total = t.memory_info("cuda:0")
      print(t.ffi.string(t.C.tt_cuda_info()) .. (" | cuda:0: %.1f GiB, %.1f GiB free"):format(total / 2 ^ 30, free / 2 ^ 30))
    end
    if not t.cuda_available() then
      local ffi = require("ffi")
      ffi.cdef("int cudaGetDeviceCount(int *n); const char *cudaGetErrorString(int e);")
      local n = ffi.new("int[1]")
      local ok, e = pcall(function() return ffi.C.cudaGetDeviceCount(n) end)
      print("cudaGetDeviceCount: " .. (ok and (e .. " (" .. ffi.string(ffi.C.cudaGetErrorString(e)) .. ")") or tostring(e)))
      os.exit(1)
    end' || { echo "titan cannot use the GPU (see the line above): the CUDA specs would all be skipped"; return 1; }
  # Ten specs at once (one wave: the slowest sets the time), two CPU threads
  # each for their CPU references, on the machine's 16 cores.
  # NCCL at world 1 bootstraps over a local socket; the machine has no
  # network, so name the loopback interface rather than let NCCL search.
  cd "$BUILD" && NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}" OMP_NUM_THREADS=2 ctest -R "${GPU_CHECK_CUDA_TESTS:-^cuda/}" -j 10 --output-on-failure
}

bench_titan_cmd() { # budget
  [ -x "$BUILD/titan" ] || { echo "no $BUILD/titan: the build failed"; return 1; }
  local quick=()
  [ "${GPU_CHECK_QUICK:-0}" = "1" ] && quick=(--quick)
  [ -n "${GPU_CHECK_BENCH_ONLY:-}" ] && quick+=(--only "$GPU_CHECK_BENCH_ONLY")
  cd "$ROOT" && "$BUILD/titan" bench/gpu.lua --json "$SCRATCH/titan.json" --budget "$1" "${quick[@]}"
}

bench_torch_cmd() { # budget
  local quick=()
  [ "${GPU_CHECK_QUICK:-0}" = "1" ] && quick=(--quick)
  # PyTorch brings its own libraries: none of the prefix's.
  cd "$ROOT" && env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" PYTHONUNBUFFERED=1 python3 bench/gpu_torch.py --json "$SCRATCH/torch.json" \
    --titan-json "$SCRATCH/titan.json" --budget "$1" "${quick[@]}"
}

# lua/titan/data/build.lua reads the fortunes corpus from a fixed path; the
# trainer-driven specs (CUDA ones too) need it there.
link_corpus() {
  if [ ! -e /usr/share/games/fortunes/fortunes ] && [ -e "$PREFIX/usr/share/games/fortunes/fortunes" ]; then
    if [ ! -e /usr/share/games/fortunes ]; then
      mkdir -p /usr/share/games && ln -s "$PREFIX/usr/share/games/fortunes" /usr/share/games/fortunes &&
        echo "linked /usr/share/games/fortunes -> $PREFIX/usr/share/games/fortunes"
    fi
  fi
}

cpu_tests_cmd() {
  [ -x "$BUILD/titan" ] || { echo "no $BUILD/titan: the build failed"; return 1; }
  link_corpus
  local py
  py="$(command -v python3 || true)"
  if [ -n "$py" ] && env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$py" -c 'import torch' 2>/dev/null; then
    export TITAN_REFERENCE_PYTHON="$py" TITAN_HF_PYTHON="$py"
    echo "TITAN_REFERENCE_PYTHON=TITAN_HF_PYTHON=$py"
  fi
  # 4 tests at a time, the cores shared among their OpenMP threads.
  local threads=$((JOBS >= 8 ? JOBS / 4 : 1))
  export TITAN_NO_INSTALL=1
  cd "$BUILD" && OMP_NUM_THREADS=$threads ctest -E '^cuda/' -j 4 --output-on-failure
}

# ---- the run: bookkeeping and the summary ---------------------------------------

declare -A STATUS SECS
ORDER=()
T0=$SECONDS

run_step() { # name [args...]: runs <name>_cmd with the step's timeout into its log
  local name="$1" max left t log rc start
  max="$(step_timeout "$name")"
  left=$((BUDGET - (SECONDS - T0) - 10))
  t=$((max < left ? max : left))
  log="$OUTDIR/$(step_log "$name")"
  ORDER+=("$name")
  if [ "$t" -lt 20 ]; then
    STATUS[$name]="skipped (no time left: ${left}s)"
    SECS[$name]=0
    write_summary
    return 0
  fi
  {
    echo
    echo "===== $name (timeout ${t}s) $(date -u +%H:%M:%S) ====="
    echo "about: $(step_about "$name")"
  } >>"$log"
  start=$SECONDS
  say "step $name (timeout ${t}s)"
  case "$name" in
    probe | unpack | configure)
      # In this shell: they set variables later steps use.
      timeout_fn "$t" "$name" >>"$log" 2>&1
      rc=$?
      ;;
    *)
      local arg=$((t - 10))
      (
        eval "$(prefix_env "$PREFIX" "$EXTRA_LIBS")"
        # shellcheck disable=SC2086
        export -f "${name}_cmd" $CUDA_HELPERS link_corpus 2>/dev/null
        export BUILD ROOT SCRATCH PREFIX JOBS
        timeout --kill-after=10 "$t" bash -c "${name}_cmd \"\$@\"" _ "$arg"
      ) >>"$log" 2>&1
      rc=$?
      ;;
  esac
  SECS[$name]=$((SECONDS - start))
  case $rc in
    0) STATUS[$name]="ok" ;;
    124 | 137) STATUS[$name]="TIMEOUT (${t}s)" ;;
    *) STATUS[$name]="FAILED (rc $rc)" ;;
  esac
  echo "===== $name: ${STATUS[$name]} in ${SECS[$name]}s" >>"$log"
  say "step $name: ${STATUS[$name]} (${SECS[$name]}s)"
  write_summary
}

# probe/unpack/configure run in this shell (their results are variables);
# each bounded by its own timeout.
timeout_fn() { # seconds name
  local t="$1" name="$2" rc
  case "$name" in
    probe)
      # Read-only queries; nvidia-smi could hang: bounded.
      timeout --kill-after=5 "$t" bash -c "$(declare -f probe_cmd $CUDA_HELPERS); MULTIARCH=$MULTIARCH; probe_cmd"
      rc=$?
      ;;
    unpack)
      timeout --kill-after=5 "$t" bash -c "$(declare -f unpack_prefix extract_deb is_fallback_pkg debs_stamp);
        DEBS='$DEBS' MULTIARCH=$MULTIARCH FALLBACK_PACKAGES='$FALLBACK_PACKAGES'; unpack_prefix '$PREFIX' '$FALLBACK'"
      rc=$?
      link_missing_fallbacks "$FALLBACK" "$EXTRA_LIBS"
      ;;
    configure)
      (
        eval "$(prefix_env "$PREFIX" "$EXTRA_LIBS")"
        export ROOT BUILD
        timeout --kill-after=5 "$t" bash -c "$(declare -f configure_cmd); configure_cmd"
      )
      rc=$?
      ;;
  esac
  return $rc
}

# Lines of a log that matter in the summary. Read from the per-test lines,
# so a ctest killed by its timeout still gets a count.
ctest_digest() { # log
  local log="$1" passed failed skipped
  [ -f "$log" ] || return 0
  passed="$(grep -cE 'Test +#[0-9]+: .* Passed +[0-9.]+ sec' "$log")"
  failed="$(grep -cE 'Test +#[0-9]+: .*\*\*\*(Failed|Timeout|Exception|Not Run)' "$log")"
  skipped="$(grep -cE 'Test +#[0-9]+: .*\*\*\*Skipped' "$log")"
  echo "ctest: $passed passed, $failed failed, $skipped skipped (tests that finished)"
  grep -E 'tests passed|tests failed out of|Total Test time' "$log" | tail -n 2
  if [ "$failed" -gt 0 ]; then
    echo
    echo "failed:"
    grep -E 'Test +#[0-9]+: .*\*\*\*(Failed|Timeout|Exception|Not Run)' "$log" |
      sed -E 's/.*Test +#[0-9]+: ([^ ]+) .*\*\*\*([A-Za-z]+( Run)?).*/  \1 (\2)/' | head -n 40
  fi
  if [ "$skipped" -gt 0 ]; then
    echo
    echo "skipped:"
    grep -E 'Test +#[0-9]+: .*\*\*\*Skipped' "$log" | sed -E 's/.*Test +#[0-9]+: ([^ ]+) .*/  \1/' | head -n 40
  fi
  # busted: the name of each failing or erroring test is the line after the marker.
  local fails
  fails="$(grep -A1 -E '^(Failure|Error) (→|->) ' "$log" | grep -vE '^(Failure|Error) (→|->) |^--$' | sed 's/\x1b\[[0-9;]*m//g' | head -n 80)"
  if [ -n "$fails" ]; then
    echo
    echo "failing busted tests ($(grep -cE '^(Failure|Error) (→|->) ' "$log")):"
    echo "$fails" | head -n 60 | sed 's/^/  - /'
    echo
    echo "their messages (first lines, each once):"
    grep -A3 -E '^(Failure|Error) (→|->) ' "$log" | grep -vE '^(Failure|Error) (→|->) |^--$' | sed 's/\x1b\[[0-9;]*m//g' |
      grep -vxF -f <(echo "$fails") | grep -vE '^\s*$|^Traceback' | cut -c1-400 | awk '!seen[$0]++' | head -n 25 |
      sed 's/^/    /'
  fi
}

# The last lines a step wrote (its section of the log).
step_tail() { # name lines
  local log
  log="$OUTDIR/$(step_log "$1")"
  [ -f "$log" ] || return 0
  sed -n "/^===== $1 (timeout/,/^===== $1: /p" "$log" | tail -n "$2" | cut -c1-400
}

step_failed() { # name: ran and did not end ok
  local st="${STATUS[$1]:-}"
  [ -n "$st" ] && [ "$st" != ok ] && [ "${st#skipped}" = "$st" ]
}

write_summary() {
  [ -n "${OUTDIR:-}" ] || return 0
  local s="$OUTDIR/summary.md" n
  {
    echo "# Titan GPU check"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) · ${GPU_LINE:-GPU: not probed} · budget ${BUDGET}s, $((SECONDS - T0))s used"
    echo
    echo "| step | status | seconds | log |"
    echo "|---|---|---:|---|"
    for n in "${ORDER[@]}"; do
      echo "| $n | ${STATUS[$n]:-running} | ${SECS[$n]:-} | $(step_log "$n") |"
    done
    for n in probe unpack; do
      if step_failed "$n"; then
        echo
        echo "## $n (last lines)"
        echo '```'
        step_tail "$n" 15
        echo '```'
      fi
    done
    if step_failed configure; then
      echo
      echo "## configure errors"
      echo '```'
      grep -E 'CMake Error|error|not found|NOTFOUND' "$OUTDIR/setup.log" | head -n 20
      step_tail configure 8
      echo '```'
    fi
    if step_failed build; then
      echo
      echo "## build errors (first 30)"
      echo '```'
      grep -E 'error|Error' "$OUTDIR/build.log" | head -n 30
      echo '```'
    fi
    if [ -n "${STATUS[cuda_tests]:-}" ]; then
      echo
      echo "## CUDA tests"
      echo '```'
      grep -m1 '^titan .*cuda available' "$OUTDIR/cuda_tests.log"
      grep -m1 '^cudaGetDeviceCount' "$OUTDIR/cuda_tests.log"
      # which shapes cuDNN refused (the fallback kernel ran instead), once each
      grep -E 'fallback' "$OUTDIR/cuda_tests.log" | sort -u | head -n 12 | cut -c1-300
      ctest_digest "$OUTDIR/cuda_tests.log"
      echo '```'
    fi
    local b title
    for b in bench_titan bench_torch; do
      [ -n "${STATUS[$b]:-}" ] || continue
      title="Titan benchmarks (bench/gpu.lua)"
      [ "$b" = bench_torch ] && title="PyTorch on the same GPU (bench/gpu_torch.py)"
      echo
      echo "## $title"
      echo
      grep -E '^(## |\||titan |torch |note:|skipped:|error:)' "$OUTDIR/$(step_log "$b")" | cut -c1-400
      if step_failed "$b"; then
        # killed before its tables: the measurements it printed one by one
        echo
        echo '```'
        grep -E '^  \[' "$OUTDIR/$(step_log "$b")" | cut -c1-300
        grep -E 'fallback' "$OUTDIR/$(step_log "$b")" | sort -u | head -n 8 | cut -c1-300
        step_tail "$b" 12
        echo '```'
      fi
    done
    if [ -n "${STATUS[cpu_tests]:-}" ]; then
      echo
      echo "## C/Lua suite"
      echo '```'
      ctest_digest "$OUTDIR/cpu_tests.log"
      echo '```'
    fi
    echo
    echo "Reading this: docs/gpu.md. Full logs: setup.log, build.log, cuda_tests.log, bench_titan.log, bench_torch.log, cpu_tests.log; figures: results.json."
  } >"$s.tmp" 2>/dev/null && mv "$s.tmp" "$s"
  # results.json: both benchmarks' figures.
  {
    printf '{"titan": '
    cat "$SCRATCH/titan.json" 2>/dev/null || printf 'null'
    printf ', "torch": '
    cat "$SCRATCH/torch.json" 2>/dev/null || printf 'null'
    printf '}\n'
  } >"$OUTDIR/results.json" 2>/dev/null
}

run() {
  OUTDIR="$1"
  mkdir -p "$OUTDIR" "$SCRATCH" || die "cannot create $OUTDIR"
  OUTDIR="$(cd "$OUTDIR" && pwd)"
  rm -f "$SCRATCH"/*.json
  local f
  for f in setup.log build.log cuda_tests.log bench_titan.log bench_torch.log cpu_tests.log; do : >"$OUTDIR/$f"; done
  local steps="${GPU_CHECK_STEPS:-$STEPS_ALL}" s
  steps="${steps//,/ }"
  if ! ls "$DEBS"/*.deb >/dev/null 2>&1; then
    say "WARNING: no .deb in $DEBS (run --prepare here, and name .gpu/debs in the device tool's carry)"
  fi
  # Where CUDA's libraries are (CUDA_CMAKE_ARGS, CUDA_EXTRA_LIBDIRS: exported).
  find_cuda_libs >/dev/null 2>&1
  GPU_LINE="$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
  GPU_LINE="GPU: ${GPU_LINE:-none visible to nvidia-smi}"
  for s in $STEPS_ALL; do
    case " $steps " in *" $s "*) ;; *) continue ;; esac
    # The steps after unpack need the prefix: unpack (cheap, a no-op when
    # current) even when only later steps were asked for.
    if [ "$s" != probe ] && [ "$s" != unpack ] && [ ! -f "$PREFIX/.stamp" ]; then
      case " $steps " in *" unpack "*) ;; *) run_step unpack ;; esac
    fi
    run_step "$s"
  done
  write_summary
  say "done in $((SECONDS - T0))s: $OUTDIR/summary.md"
  cat "$OUTDIR/summary.md"
}

# ---- --dry-run -----------------------------------------------------------------------

dry_run() {
  local total tree n
  echo "gpu_check dry run: nothing is executed."
  echo
  echo "What travels to the GPU machine (device tool: carry [\".gpu/debs\"]; 64 MiB with the working tree):"
  if ls "$DEBS"/*.deb >/dev/null 2>&1; then
    total="$(debs_bytes)"
    tree="$(tree_bytes)"
    list_debs
    echo "  .gpu/debs: $(ls "$DEBS"/*.deb | wc -l) files, $(mib "$total") MiB; working tree (estimate, ignored folders left out): $(mib "$tree") MiB; together $(mib $((total + tree))) MiB"
    local missing=() p
    for p in "${PACKAGES[@]}"; do ls "$DEBS/${p}_"*.deb >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] || echo "  WARNING: missing from .gpu/debs: ${missing[*]} (rerun --prepare)"
  else
    echo "  WARNING: .gpu/debs has no .deb: run scripts/gpu_check.sh --prepare first; without them the GPU machine cannot build (no LuaJIT there)"
  fi
  echo
  echo "Run there (one command, at most 10 minutes; timeout_s 600):  bash scripts/gpu_check.sh \"\$OUT\"   (budget ${BUDGET}s: GPU_CHECK_BUDGET)"
  echo
  echo "Steps (each with its own timeout, cut to what is left of the budget; a failure does not stop the next step;"
  echo "summary.md is rewritten after every step):"
  n=0
  for s in $STEPS_ALL; do
    n=$((n + 1))
    printf '  %d. %-11s timeout %3ss  log %-16s\n     %s\n' "$n" "$s" "$(step_timeout "$s")" "$(step_log "$s")" "$(step_about "$s")"
  done
  echo
  echo "Environment for the steps after unpack (prefix = $PREFIX):"
  prefix_env "$PREFIX" "$EXTRA_LIBS" | sed 's/^/  /'
  echo "  (+ CUDA_EXTRA_LIBDIRS: the folders of cuDNN/NCCL/cuBLASLt when found outside the toolkit and system folders)"
  echo
  echo "CUDA detection as it would run on this machine (the GPU machine's answer may differ):"
  local found
  found="$(mktemp)"
  find_cuda_libs >"$found"
  sed 's/^/  /' "$found"
  rm -f "$found"
  echo "  configure extra args: ${CUDA_CMAKE_ARGS:-(none)}"
  echo "  extra LD_LIBRARY_PATH: ${CUDA_EXTRA_LIBDIRS:-(none)}"
  echo
  echo "OUTDIR receives 8 files: summary.md setup.log build.log cuda_tests.log bench_titan.log bench_torch.log cpu_tests.log results.json"
}

# Sourced (tests/lua/gpu_check_spec.lua calls its functions), it stops here.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    --prepare) prepare ;;
    --dry-run) dry_run ;;
    --selftest) selftest_prefix ;;
    -h | --help | "") sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' ;;
    -*) die "unknown option $1 (expected --prepare, --dry-run or OUTDIR)" ;;
    *) run "$1" ;;
  esac
fi
