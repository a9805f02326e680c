#!/usr/bin/env bash
# Compile every kernel source as the extension's JIT build does, compile only (no GPU needed):
# each kernels/*.cu with nvcc for Hopper (sm_90a), printing one line of registers / spills /
# shared memory per kernel, and each kernels/*.cpp (the torch bindings) with the host compiler.
# The arguments come from sparse_llm.ops._extension, the one place they are written
# (`python -m sparse_llm.ops.build --print-flags nvcc|cxx`), so the package and torch must be
# installed first (`make setup`). Runs $JOBS compiles at a time (default: the cores). Fails on any
# compile error. Used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
CXX=${CXX:-c++}  # torch's JIT build compiles the .cpp files with $CXX, else c++
JOBS=${JOBS:-$(nproc)}
command -v "$NVCC" >/dev/null || { echo "compile_kernels: nvcc not found" >&2; exit 1; }
command -v "$CXX" >/dev/null || { echo "compile_kernels: host compiler $CXX not found" >&2; exit 1; }
nvcc_out=$("$PYTHON" -m sparse_llm.ops.build --print-flags nvcc)
cxx_out=$("$PYTHON" -m sparse_llm.ops.build --print-flags cxx)
mapfile -t nvcc_flags <<<"$nvcc_out"
mapfile -t cxx_flags <<<"$cxx_out"
# A CPU build of torch (CI's) ships c10/cuda's headers but not the one CMake generates for CUDA
# builds, c10/cuda/impl/cuda_cmake_macros.h (its one define matters on Windows alone): where no
# include directory has it, tell c10 to skip it. A CUDA build of torch, the JIT's, compiles as is.
generated=0
for flag in "${cxx_flags[@]}"; do
  if [ -f "$flag/c10/cuda/impl/cuda_cmake_macros.h" ]; then generated=1; fi
done
[ $generated = 1 ] || cxx_flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
cu_sources=(kernels/*.cu)
cpp_sources=(kernels/*.cpp)
[ ${#cu_sources[@]} -gt 0 ] || { echo "compile_kernels: no kernels/*.cu" >&2; exit 1; }
[ ${#cpp_sources[@]} -gt 0 ] || { echo "compile_kernels: no kernels/*.cpp" >&2; exit 1; }

# start LOG COMMAND...: runs COMMAND in the background once fewer than $JOBS run, its output in
# $out/LOG and its exit status in $out/LOG.rc.
start() {
  local log=$1
  shift
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  (
    rc=0
    "$@" >"$out/$log" 2>&1 || rc=$?
    echo "$rc" >"$out/$log.rc"
  ) &
}

# The bindings first: each takes longer than any kernel (torch's headers).
for src in "${cpp_sources[@]}"; do
  name=$(basename "$src")
  start "$name.log" "$CXX" -c "${cxx_flags[@]}" "$src" -o "$out/$name.o"
done
for src in "${cu_sources[@]}"; do
  name=$(basename "$src")
  start "$name.log" "$NVCC" -c "${nvcc_flags[@]}" -Xptxas -v "$src" -o "$out/$name.o"
done
wait

status=0
# failed SRC: whether SRC failed to compile (then its log is printed).
failed() {
  local log="$out/$(basename "$1").log"
  if [ "$(cat "$log.rc")" != 0 ]; then
    echo "FAILED: $1"
    cat "$log"
    return 0
  fi
  return 1
}
for src in "${cu_sources[@]}"; do
  if failed "$src"; then status=1; continue; fi
  log="$out/$(basename "$src").log"
  # ptxas prints, per entry: "Compiling entry function '<mangled>'", then stack/spill and register lines.
  awk -v file="$(basename "$src")" '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes stack frame/ { stack = $1; spill_st = $5; spill_ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      smem = "0"; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
      short = fn; if (match(fn, /[0-9]+[a-z_]+_kernel/)) { short = substr(fn, RSTART, RLENGTH); sub(/^[0-9]+/, "", short) }
      printf "%-22s %-28s regs %3s  stack %4s B  spill st/ld %s/%s B  static smem %s B\n", file, short, regs, stack, spill_st, spill_ld, smem
    }' "$log"
  if grep -q "warning" "$log"; then grep "warning" "$log"; fi
done
for src in "${cpp_sources[@]}"; do
  if failed "$src"; then status=1; continue; fi
  echo "$(basename "$src"): compiled ($CXX)"
  log="$out/$(basename "$src").log"
  if grep -q "warning" "$log"; then grep -A3 "warning" "$log"; fi
done
[ $status = 0 ] || echo "compile_kernels: some kernel sources failed to compile" >&2
exit $status
