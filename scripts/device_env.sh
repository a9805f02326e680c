# Sourced on a GPU machine (by scripts/gpu_check.sh and `make bench-headline`), from the repository
# root: installs the packages a GPU machine's Python lacks (hydra-core, omegaconf, datasets, ...)
# from the wheels in $WHEELS (default .whl) into /tmp/wheels/site-packages, and puts them and the
# repository on PYTHONPATH. Returns non-zero if the install fails. The folder's name matters: dill
# (datasets' hashing, which lm-eval's data load runs) pickles a module by value unless its path
# holds "site-packages", and pickling pyarrow by value fails (its MonthDayNano type).
export PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wheels/site-packages "$WHEELS"/*.whl || return 1
  export PYTHONPATH=/tmp/wheels/site-packages
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
