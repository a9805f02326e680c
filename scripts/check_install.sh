#!/usr/bin/env bash
# CI: the package installs whole. A non-editable install (what `pip install .` or a wheel gives)
# must carry the kernel sources and the Hydra configs inside the package, and its
# `sparse-llm-train` must train from any directory (and, with lm-eval installed, `sparse-llm-eval`
# evaluate the result on the shipped tasks). The install goes into a fresh virtual
# environment that sees the site packages `make setup` installed (torch and the rest), so nothing
# is downloaded, from a copy of the repository's files (what a clone holds, plus new files not yet
# added), so no stale build/ of the checkout leaks into it. Takes well under a minute.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir "$work/src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (
    cd "$repo"
    git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md sparse_llm kernels configs |
      while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
      tar --null -T - -cf -
  ) | tar -xf - -C "$work/src"
else
  (cd "$repo" && tar --exclude=__pycache__ -cf - pyproject.toml README.md sparse_llm kernels configs) |
    tar -xf - -C "$work/src"
fi

# --without-pip: the venv's own (older) pip and setuptools would shadow the site's; the site's pip
# installs into the venv all the same, with the site's setuptools (--no-build-isolation).
"$PYTHON" -m venv --system-site-packages --without-pip "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$work/src"

mkdir "$work/run"
cd "$work/run"
"$work/venv/bin/python" - "$work/venv" "$repo" <<'EOF'
import sys
from pathlib import Path

import sparse_llm
from sparse_llm.ops import _extension
from sparse_llm.train import CONFIG_DIR

venv, repo = (Path(p).resolve() for p in sys.argv[1:])
package = Path(sparse_llm.__file__).resolve().parent
assert venv in package.parents, f"sparse_llm was imported from {package}, not from the venv {venv}"
kernels, configs = package / "kernels", package / "configs"
assert _extension.kernel_dir() == kernels, f"kernel_dir() is {_extension.kernel_dir()}, not {kernels}"
assert CONFIG_DIR == configs, f"the configs are read from {CONFIG_DIR}, not {configs}"
for pattern in ("*.cu", "*.cuh", "*.cpp", "*.h"):
    assert list(kernels.glob(pattern)), f"no kernels/{pattern} in the installed package"
assert (configs / "config.yaml").is_file(), "no configs/config.yaml in the installed package"


def names(root: Path, pattern: str) -> set[str]:
    return {str(p.relative_to(root)) for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}


missing = (names(repo / "kernels", "*") - names(kernels, "*")) | {
    f"configs/{n}" for n in names(repo / "configs", "**/*") - names(configs, "**/*")
}
assert not missing, f"not installed: {sorted(missing)} (package-data in pyproject.toml)"
print(f"check_install: sparse_llm installed in {package}, with {len(list(kernels.iterdir()))} kernel files and its configs")
EOF

# The default config: a tiny model on the embedded data, on the CPU.
if ! "$work/venv/bin/sparse-llm-train" train.max_steps=2 logger=none run_dir="$work/run/out" >"$work/train.log" 2>&1; then
  cat "$work/train.log"
  echo "check_install: sparse-llm-train failed in the installed package" >&2
  exit 1
fi
tail -n 2 "$work/train.log"
grep -q "^run_dir: $work/run/out" "$work/train.log" ||
  { echo "check_install: sparse-llm-train did not report its run_dir" >&2; exit 1; }

# The shipped evaluation tasks (YAML and data are package data) run from the installed package.
if "$work/venv/bin/python" -c "import lm_eval" 2>/dev/null; then
  if ! "$work/venv/bin/sparse-llm-eval" "$work/run/out" --tasks offline --limit 2 >"$work/eval.log" 2>&1; then
    cat "$work/eval.log"
    echo "check_install: sparse-llm-eval failed in the installed package" >&2
    exit 1
  fi
  grep -q "| python_perplexity | bits_per_byte |" "$work/eval.log" ||
    { echo "check_install: sparse-llm-eval printed no results table" >&2; exit 1; }
fi
echo "check_install: ok"
