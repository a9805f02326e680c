"""Ahead-of-time build of the CUDA extension, and the flags CI compiles the kernels with.

    python -m sparse_llm.ops.build                      build the extension now (needs a CUDA GPU
                                                        and the toolchain): fills the cache the JIT
                                                        path reads, so a first kernel call does not
                                                        compile
    python -m sparse_llm.ops.build --print-flags nvcc   the arguments the JIT build gives nvcc for a
                                                        .cu file, one a line
    python -m sparse_llm.ops.build --print-flags cxx    those it gives the host compiler for a .cpp
                                                        file, one a line

The flags themselves are written once, in `sparse_llm.ops._extension`; scripts/compile_kernels.sh
reads them from here to compile every kernel source on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import sys

from sparse_llm.ops import _extension


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_llm.ops.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--print-flags",
        choices=("nvcc", "cxx"),
        help="print the compiler arguments of the JIT build, one a line, and exit (no GPU needed)",
    )
    args = parser.parse_args(argv)
    if args.print_flags is not None:
        print("\n".join(_extension.compile_args(args.print_flags)))
        return 0
    import torch

    # Only what the build itself needs (kernels_unavailable would build the extension quietly).
    reason = "no CUDA GPU" if not torch.cuda.is_available() else _extension.missing_toolchain()
    if reason is not None:
        print(f"sparse_llm.ops.build: cannot build the CUDA extension here: {reason}", file=sys.stderr)
        return 1
    module = _extension.build(verbose=True)
    print(f"sparse_llm.ops.build: built {module.__name__} in {_extension.build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
