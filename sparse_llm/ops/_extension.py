"""Build and load the CUDA extension (the package's kernels/*.cu + kernels/*.cpp): nothing else.

JIT through torch.utils.cpp_extension.load with ninja. The module name carries a hash of the
sources and flags, so an edited kernel gets a fresh build and an unchanged one is loaded from the
cache: $SPARSE_LLM_CACHE, else $TORCH_EXTENSIONS_DIR/sparse_llm, else ~/.cache/sparse_llm/extensions.

The sources ship inside the package (`sparse_llm/kernels`, mapped from the repository's top-level
`kernels/` at install time; see pyproject.toml), so an installed wheel builds the same extension
as a checkout. Whether the kernels may run on a device is `sparse_llm.ops.select`'s question.
"""

from __future__ import annotations

import functools
import hashlib
import os
from importlib import resources
from pathlib import Path
from types import ModuleType

# The one place the kernels' compiler flags are written: the JIT build below and CI's compile
# check (`python -m sparse_llm.ops.build --print-flags`, scripts/compile_kernels.sh) read them.
CUDA_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
NVCC_FLAGS = ("-O3", CUDA_ARCH, "-lineinfo")
CXX_FLAGS = ("-O3",)


def kernel_dir() -> Path:
    """Where the kernel sources are: the installed package's `kernels/`, else the checkout's."""
    packaged = Path(str(resources.files("sparse_llm") / "kernels"))
    if (packaged / "bindings.cpp").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "kernels"  # an editable install of a checkout


def kernel_sources() -> list[Path]:
    """What is compiled: every .cu and the torch bindings (.cpp)."""
    directory = kernel_dir()
    return [*sorted(directory.glob("*.cu")), *sorted(directory.glob("*.cpp"))]


def _source_hash() -> str:
    directory = kernel_dir()
    digest = hashlib.sha256()
    headers = [*directory.glob("*.cuh"), *directory.glob("*.h")]
    for path in sorted([*kernel_sources(), *headers]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join((*NVCC_FLAGS, *CXX_FLAGS)).encode())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    if "SPARSE_LLM_CACHE" in os.environ:
        root = Path(os.environ["SPARSE_LLM_CACHE"])
    elif "TORCH_EXTENSIONS_DIR" in os.environ:
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "sparse_llm"
    else:
        root = Path.home() / ".cache" / "sparse_llm" / "extensions"
    return root / f"twell_{_source_hash()}"


def missing_toolchain() -> str | None:
    """What the build lacks here (nvcc, ninja, the sources), or None."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    if not (kernel_dir() / "bindings.cpp").is_file():
        return f"kernel sources not found under {kernel_dir()}"
    return None


def build(verbose: bool = False) -> ModuleType:
    """Compile (or load from the cache) the extension; raises on any failure."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"sparse_llm_twell_{_source_hash()}",
        sources=[str(p) for p in kernel_sources()],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        extra_include_paths=[str(kernel_dir())],
        build_directory=str(directory),
        verbose=verbose,
    )


@functools.cache
def load() -> ModuleType | str:
    """The extension, or one line saying why it could not be built (tried once per process)."""
    missing = missing_toolchain()
    if missing is not None:
        return missing
    try:
        return build()
    except Exception as exc:  # a broken toolchain must not crash the caller: it falls back
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"building the CUDA extension failed ({first_line})"
