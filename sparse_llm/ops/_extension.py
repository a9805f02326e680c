"""Build and load the CUDA extension (the package's kernels/*.cu + kernels/*.cpp), and say whether
it runs on a device: the one place the package loads it.

JIT through torch.utils.cpp_extension.load with ninja. The module name carries a hash of the
sources and flags, so an edited kernel gets a fresh build and an unchanged one is loaded from the
cache: $SPARSE_LLM_CACHE, else $TORCH_EXTENSIONS_DIR/sparse_llm, else ~/.cache/sparse_llm/extensions.

The sources ship inside the package (`sparse_llm/kernels`, mapped from the repository's top-level
`kernels/` at install time; see pyproject.toml), so an installed wheel builds the same extension
as a checkout. Every kernel-backed op asks `kernels_unavailable` whether the extension runs on its
device (and `extension` for the loaded module); which FFN implementation runs is
`sparse_llm.ops.ffn.select`'s question.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sysconfig
from importlib import resources
from pathlib import Path
from types import ModuleType

import torch

# The one place the kernels' compiler flags are written: the JIT build below and CI's compile
# check (`python -m sparse_llm.ops.build --print-flags`, scripts/compile_kernels.sh) read them.
# The C++ standard is pinned here rather than left to torch's default, so both compile the same.
CUDA_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
CXX_STD = "-std=c++20"
NVCC_FLAGS = ("-O3", CXX_STD, CUDA_ARCH, "-lineinfo")
CXX_FLAGS = ("-O3", CXX_STD)


def link_flags() -> list[str]:
    """The extension must use the process's C++ runtime, the libstdc++ torch loaded. A host
    compiler that links its own libstdc++ into the module (seen on the GPU machines: their CXX
    finds only a static libstdc++) leaves two runtimes in the process, and the second one's
    iostreams are never set up: formatting a number into an error message (c10::str in a failed
    check) crashed the process. Naming the loaded shared libstdc++ on the link line makes the link
    take every C++ runtime symbol from it (Linux; elsewhere the compiler's default stands). torch,
    imported above, has loaded it."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    loaded = {line.split()[-1] for line in maps.read_text().splitlines() if "/libstdc++.so" in line}
    return ["-Wl,--no-as-needed", *sorted(loaded)[:1]] if loaded else []


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


def _abi_defines() -> list[str]:
    """torch's C++ ABI, passed explicitly (older torch versions' JIT passed it, newer ones rely
    on the compiler's default agreeing with torch's)."""
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def jit_flags() -> tuple[list[str], list[str]]:
    """(nvcc flags, host compiler flags) the build adds to torch's own (its defines, includes)."""
    return [*NVCC_FLAGS, *_abi_defines()], [*CXX_FLAGS, *_abi_defines()]


def _source_hash() -> str:
    directory = kernel_dir()
    digest = hashlib.sha256()
    headers = [*directory.glob("*.cuh"), *directory.glob("*.h")]
    for path in sorted([*kernel_sources(), *headers]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    nvcc_flags, cxx_flags = jit_flags()
    digest.update(" ".join((*nvcc_flags, *cxx_flags, *link_flags())).encode())
    return digest.hexdigest()[:12]


def extension_name() -> str:
    return f"sparse_llm_twell_{_source_hash()}"


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


def cuda_home() -> Path | None:
    """The CUDA toolkit's root (the directory of include/cuda_runtime.h): $CUDA_HOME or
    $CUDA_PATH, torch's guess, nvcc's parent on PATH, /usr/local/cuda; the first that holds the
    headers (torch's own guess is None in a CPU build, and nvcc on PATH may be a wrapper)."""
    from torch.utils import cpp_extension

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").is_file():
            return Path(candidate)
    return None


def compile_args(kind: str) -> list[str]:
    """What the JIT build passes to nvcc for a .cu file (kind 'nvcc') or to the host compiler for a
    .cpp file (kind 'cxx'), but -c, the input and the output: the defines torch adds, the include
    paths (the kernel directory, torch's headers, CUDA's, Python's) and the flags above. CI
    compiles every source with these (scripts/compile_kernels.sh)."""
    from torch.utils import cpp_extension

    if kind not in ("nvcc", "cxx"):
        raise ValueError(f"kind must be 'nvcc' or 'cxx', got {kind!r}")
    system_includes = list(cpp_extension.include_paths())
    home = cuda_home()
    if home is not None and str(home / "include") != "/usr/include":
        system_includes.append(str(home / "include"))
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    if python_include is not None:
        system_includes.append(python_include)
    common = [
        f"-DTORCH_EXTENSION_NAME={extension_name()}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-I{kernel_dir()}",
    ]
    for include in system_includes:
        common += ["-isystem", include]
    nvcc_flags, cxx_flags = jit_flags()
    if kind == "cxx":
        return [*common, "-fPIC", *cxx_flags]
    return [*common, *cpp_extension.COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *nvcc_flags]


def build(verbose: bool = False) -> ModuleType:
    """Compile (or load from the cache) the extension; raises on any failure."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    nvcc_flags, cxx_flags = jit_flags()
    return cpp_extension.load(
        name=extension_name(),
        sources=[str(p) for p in kernel_sources()],
        extra_cflags=cxx_flags,
        extra_cuda_cflags=nvcc_flags,
        extra_ldflags=link_flags(),
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


class KernelsUnavailable(ValueError):
    """The CUDA kernels were asked for (impl='cuda') where they cannot run: inputs they do not take,
    or a device or toolchain they cannot run on."""


@functools.cache
def _load_on(device_index: int) -> ModuleType | str:
    """The loaded extension, or why it cannot be had on this device (cached: one build try)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device_index)
        return f"GPU {name} is sm_{major}{minor}; the kernels need Hopper (sm_90)"
    return load()


def kernels_unavailable(device: torch.device | str) -> str | None:
    """Why the CUDA extension cannot run on `device`, or None when it can (builds it on first ask
    on a Hopper GPU; a failed build is reported here, not raised)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"tensors are on {device}, the kernels need a CUDA (Hopper) GPU"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return _problem_on(_index(device)) or None


def _problem_on(device_index: int) -> str:
    """'' when the extension runs on this CUDA device, else why not. A constant to torch.compile,
    which must not trace the build (its toolchain probes are not traceable)."""
    loaded = _load_on(device_index)
    return loaded if isinstance(loaded, str) else ""


# Only CUDA devices get here (kernels_unavailable). Marking it imports torch._dynamo, 2.5 s of a
# command's start on a CPU machine (a config error took 11.5 s instead of 8), where it is not needed.
if torch.cuda.is_available():
    _problem_on = torch.compiler.assume_constant_result(_problem_on)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def extension(device: torch.device | str | None = None) -> ModuleType:
    """The loaded extension; raises KernelsUnavailable with the reason where it cannot run."""
    device = device if device is not None else torch.device("cuda")
    reason = kernels_unavailable(device)
    if reason is not None:
        raise KernelsUnavailable(f"sparse_llm CUDA extension unavailable: {reason}")
    return _load_on(_index(torch.device(device)))  # type: ignore[return-value]
