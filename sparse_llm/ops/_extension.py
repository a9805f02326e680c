"""Build and load the CUDA extension (kernels/*.cu + kernels/*.cpp) on first use.

JIT through torch.utils.cpp_extension.load with ninja. The module name carries a hash of the
sources, so an edited kernel gets a fresh build and an unchanged one is loaded from the cache:
$SPARSE_LLM_CACHE, else $TORCH_EXTENSIONS_DIR/sparse_llm, else ~/.cache/sparse_llm/extensions.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"]


def kernel_sources() -> list[Path]:
    """What is compiled: every .cu and the torch bindings (.cpp)."""
    return [*sorted(KERNEL_DIR.glob("*.cu")), *sorted(KERNEL_DIR.glob("*.cpp"))]


def _source_hash() -> str:
    digest = hashlib.sha256()
    headers = [*KERNEL_DIR.glob("*.cuh"), *KERNEL_DIR.glob("*.h")]
    for path in sorted([*kernel_sources(), *headers]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(NVCC_FLAGS).encode())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    if "SPARSE_LLM_CACHE" in os.environ:
        root = Path(os.environ["SPARSE_LLM_CACHE"])
    elif "TORCH_EXTENSIONS_DIR" in os.environ:
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "sparse_llm"
    else:
        root = Path.home() / ".cache" / "sparse_llm" / "extensions"
    return root / f"twell_{_source_hash()}"


@functools.cache
def unavailable_reason() -> str | None:
    """Why the extension cannot be built or run here, or None (no build is attempted; cached:
    the ninja probe starts a process)."""
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"GPU {torch.cuda.get_device_name()} is sm_{major}{minor}; the kernels need Hopper (sm_90)"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    if not (KERNEL_DIR / "bindings.cpp").is_file():
        return f"kernel sources not found under {KERNEL_DIR}"
    return None


def build(verbose: bool = False) -> ModuleType:
    """Compile (or load from the cache) the extension; raises on any failure."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"sparse_llm_twell_{_source_hash()}",
        sources=[str(p) for p in kernel_sources()],
        extra_cflags=["-O3"],
        extra_cuda_cflags=NVCC_FLAGS,
        extra_include_paths=[str(KERNEL_DIR)],
        build_directory=str(directory),
        verbose=verbose,
    )


@functools.cache
def load() -> ModuleType | None:
    """The extension, or None after one warning that says why the reference path is used."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return build()
        except Exception as exc:  # a broken toolchain must not crash the caller: fall back
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reason = f"building the CUDA extension failed ({first_line})"
    warnings.warn(f"sparse_llm.ops: {reason}; using the PyTorch reference path", stacklevel=3)
    return None


@torch.compiler.assume_constant_result
def available() -> bool:
    """True when the extension is loaded (built on first call); a constant under torch.compile."""
    return load() is not None
