#!/usr/bin/env bash
# Compile every kernels/*.cu for Hopper (sm_90a), compile only (no GPU needed), and print one line
# of registers / spills / shared memory per kernel. Fails on any compile error. Used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "compile_kernels: nvcc not found" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
sources=(kernels/*.cu)
[ ${#sources[@]} -gt 0 ] || { echo "compile_kernels: no kernels/*.cu" >&2; exit 1; }
pids=()
for src in "${sources[@]}"; do
  name=$(basename "$src" .cu)
  "$NVCC" -c -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Ikernels \
    "$src" -o "$out/$name.o" >"$out/$name.log" 2>&1 &
  pids+=("$!")
done
status=0
for i in "${!sources[@]}"; do
  name=$(basename "${sources[$i]}" .cu)
  if ! wait "${pids[$i]}"; then
    echo "FAILED: ${sources[$i]}"; cat "$out/$name.log"; status=1; continue
  fi
  # ptxas prints, per entry: "Compiling entry function '<mangled>'", then stack/spill and register lines.
  awk -v file="$name.cu" '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes stack frame/ { stack = $1; spill_st = $5; spill_ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      smem = "0"; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
      short = fn; if (match(fn, /[0-9]+[a-z_]+_kernel/)) { short = substr(fn, RSTART, RLENGTH); sub(/^[0-9]+/, "", short) }
      printf "%-22s %-28s regs %3s  stack %4s B  spill st/ld %s/%s B  static smem %s B\n", file, short, regs, stack, spill_st, spill_ld, smem
    }' "$out/$name.log"
  if grep -q "warning" "$out/$name.log"; then grep "warning" "$out/$name.log"; fi
done
exit $status
