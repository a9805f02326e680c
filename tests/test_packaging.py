"""The package's resources resolve, and pyproject.toml installs all of them.

The kernel sources and the Hydra configs live at the repository's top level and are mapped into
the package at install time (pyproject.toml); scripts/check_install.sh checks a real non-editable
install, these tests the parts that need no install.
"""

import fnmatch
import sys
from pathlib import Path

import pytest

from sparse_llm.config import CONFIG_DIR, config_dir
from sparse_llm.ops import _extension

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setuptools_config():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_kernel_sources_resolve():
    directory = _extension.kernel_dir()
    assert (directory / "bindings.cpp").is_file()
    names = {p.name for p in _extension.kernel_sources()}
    assert "bindings.cpp" in names and any(n.endswith(".cu") for n in names)


def test_config_dir_resolves():
    assert config_dir() == CONFIG_DIR
    assert (CONFIG_DIR / "config.yaml").is_file()


def test_every_subpackage_is_listed(setuptools_config):
    """The package-dir mapping needs the packages by name: a new subpackage must be added there."""
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "sparse_llm").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    missing = found - set(setuptools_config["packages"])
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.parametrize(
    ("package", "directory"), [("sparse_llm.kernels", "kernels"), ("sparse_llm.configs", "configs")]
)
def test_every_resource_file_is_installed(setuptools_config, package, directory):
    """Every file of kernels/ and configs/ matches the package-data patterns that install it."""
    assert setuptools_config["package-dir"][package] == directory
    patterns = setuptools_config["package-data"][package]
    root = REPO / directory
    files = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    # setuptools' "**/" also matches no directory at all
    unmatched = [
        f
        for f in files
        if not any(fnmatch.fnmatch(f, pat) or fnmatch.fnmatch(f, pat.replace("**/", "")) for pat in patterns)
    ]
    assert files and not unmatched, f"{unmatched} would not be installed: extend package-data for {package}"


def test_the_shipped_eval_tasks_are_installed(setuptools_config):
    """The offline tasks' YAML and data files sit in a package directory: package-data must list them."""
    from sparse_llm.eval.tasks import SHIPPED_TASKS, TASK_DIR

    patterns = setuptools_config["package-data"]["sparse_llm.eval.tasks"]
    files = [p.name for p in TASK_DIR.iterdir() if p.is_file() and p.suffix != ".py"]
    unmatched = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not unmatched, f"{unmatched} would not be installed: extend package-data for sparse_llm.eval.tasks"
    assert {f"{task}.yaml" for task in SHIPPED_TASKS} <= set(files)


def test_print_flags_lists_the_jit_flags(capsys):
    """`python -m sparse_llm.ops.build --print-flags` (read by scripts/compile_kernels.sh) prints
    the flags written in _extension, one argument a line."""
    from sparse_llm.ops import build

    for kind, flags in (("nvcc", _extension.NVCC_FLAGS), ("cxx", _extension.CXX_FLAGS)):
        assert build.main(["--print-flags", kind]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed == _extension.compile_args(kind)
        assert all(flag in printed for flag in flags)
        assert "-DTORCH_API_INCLUDE_EXTENSION_H" in printed
        assert any(arg.startswith("-D_GLIBCXX_USE_CXX11_ABI=") for arg in printed)
        assert f"-I{_extension.kernel_dir()}" in printed
