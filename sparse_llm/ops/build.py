"""Ahead-of-time build of the CUDA extension: `python -m sparse_llm.ops.build`.

Fills the same cache the JIT path reads, so the first call of a kernel does not compile.
"""

from __future__ import annotations

import sys

from sparse_llm.ops import _extension


def main() -> int:
    reason = _extension.unavailable_reason()
    if reason is not None:
        print(f"sparse_llm.ops.build: cannot build here: {reason}", file=sys.stderr)
        return 1
    module = _extension.build(verbose=True)
    print(f"sparse_llm.ops.build: built {module.__name__} in {_extension.build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
