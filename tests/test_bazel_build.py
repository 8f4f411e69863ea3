"""tools/bazel_build.sh's handling of JAX_EP_PYTHON, with a stub `bazel` first on PATH that logs what
it was given: nothing is built, and CI machines without bazel run it the same way."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "bazel_build.sh"


def run_script(tmp_path: Path, python: str, cwd: Path) -> tuple[int, str, Path]:
    """Runs the script from `cwd` with JAX_EP_PYTHON=`python`; returns (exit code, output, the stub
    bazel's log: one line per call, the JAX_EP_PYTHON it saw)."""
    bin_dir = tmp_path / "stub_bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "bazel_calls.txt"
    stub = bin_dir / "bazel"
    stub.write_text(f'#!/bin/bash\necho "JAX_EP_PYTHON=$JAX_EP_PYTHON" >> {log}\n')
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", JAX_EP_PYTHON=python)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, log


@pytest.mark.parametrize("kind", ["missing", "not_executable", "directory"])
def test_bad_python_is_named_before_bazel_runs(tmp_path, kind):
    target = tmp_path / "venv" / "bin" / "python"
    if kind != "missing":
        target.parent.mkdir(parents=True)
        if kind == "not_executable":
            target.write_text("#!/bin/sh\n")
            target.chmod(0o644)
        else:
            target.mkdir()
    value = "venv/bin/python"  # relative to the caller's directory, tmp_path
    rc, output, log = run_script(tmp_path, value, cwd=tmp_path)
    assert rc == 1, output
    assert f"JAX_EP_PYTHON={value} is not an executable file" in output, output
    assert not log.exists(), log.read_text()


def test_bare_name_not_on_path_is_named(tmp_path):
    rc, output, log = run_script(tmp_path, "no_such_python_jax_ep", cwd=tmp_path)
    assert rc == 1, output
    assert "JAX_EP_PYTHON=no_such_python_jax_ep is not an executable file" in output, output
    assert not log.exists(), log.read_text()


@pytest.mark.skipif(not Path("/usr/share/bazel/rules/cc").is_dir()
                    or not Path("/usr/share/bazel/platforms").is_dir(),
                    reason="Debian's bazel rules are not installed (the script stops before bazel)")
def test_relative_python_reaches_bazel_absolute(tmp_path):
    # bazel's repository rule runs the interpreter from its external directory: the script must hand
    # it the path the caller meant, made absolute against the caller's directory (not the repo root)
    caller = tmp_path / "caller"
    target = caller / "venv" / "bin" / "python"
    target.parent.mkdir(parents=True)
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    rc, output, log = run_script(tmp_path, "venv/bin/python", cwd=caller)
    assert rc == 0, output
    assert log.read_text().splitlines() == [f"JAX_EP_PYTHON={target}"]


def _split_nvcc(flags: list[str]) -> set[str]:
    """One entry per flag, -Xcompiler=a,b split into -Xcompiler=a and -Xcompiler=b."""
    out = set()
    for flag in flags:
        if flag.startswith("-Xcompiler="):
            out.update(f"-Xcompiler={f}" for f in flag.removeprefix("-Xcompiler=").split(","))
        else:
            out.add(flag)
    return out


def _bzl_lists(path: Path, names: set[str]) -> dict[str, list[str]]:
    """The top-level list literals `names` of a .bzl file (Starlark parses as Python here)."""
    tree = ast.parse(path.read_text())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in names}


def test_bazel_nvcc_flags_match_cmake():
    # docs/native.md: the bazel genrules use the same nvcc flags as CMake. CMake's come from each
    # kernel library's target_compile_options (its gencode variable's default substituted) plus what
    # CMake derives from target properties and the Release build type (the `derived` set below).
    cmake = (ROOT / "CMakeLists.txt").read_text()
    defaults = {var: value.replace(";", " ")
                for var, value in re.findall(r'set\((JAX_EP_\w*GENCODE)\s+"([^"]*)"', cmake)}
    options = re.findall(r"\$<\$<COMPILE_LANGUAGE:CUDA>:\$\{(JAX_EP_\w*GENCODE)\}([^>]*)>", cmake)
    assert {var for var, _ in options} == {"JAX_EP_CUDA_GENCODE", "JAX_EP_RDC_GENCODE"}, options
    bazel_gencode = {"JAX_EP_CUDA_GENCODE": "CUDA_GENCODE", "JAX_EP_RDC_GENCODE": "RDC_GENCODE"}
    bzl = _bzl_lists(ROOT / "bazel" / "cuda.bzl", {"NVCC_FLAGS", *bazel_gencode.values()})
    # CUDA_STANDARD 17, Release (-O3 -DNDEBUG), POSITION_INDEPENDENT_CODE, CUDA_VISIBILITY_PRESET hidden,
    # and the include directory PROJECT_SOURCE_DIR (bazel: the execroot)
    derived = {"-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-I."}
    for var, rest in options:
        want = _split_nvcc((defaults[var] + " " + rest).split()) | derived
        got = _split_nvcc(bzl["NVCC_FLAGS"] + bzl[bazel_gencode[var]])
        assert got == want, (var, sorted(got - want), sorted(want - got))


def test_native_md_says_what_the_bazel_build_compiles_against():
    # The bazel build takes jaxlib's FFI headers and the NVSHMEM wheel from JAX_EP_PYTHON's environment
    # (bazel/local_deps.bzl), not pip's [build-system] pins: docs/native.md names those pins, which
    # constraints.txt (the make install venv) must repeat for its "the headers and NVSHMEM pip used"
    # to hold; and it names the function telling which _C a process uses.
    build_requires = re.search(r"^requires = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                               re.S | re.M).group(1)
    constraints = (ROOT / "constraints.txt").read_text().splitlines()
    native = " ".join((ROOT / "docs" / "native.md").read_text().split())
    for package in ("jaxlib", "nvidia-nvshmem-cu13"):
        pin = re.search(rf'"{package}==([\w.]+)', build_requires).group(1)
        assert f"{package}=={pin}" in constraints, (package, pin)
        assert pin in native, (package, pin)
    bzl = (ROOT / "bazel" / "local_deps.bzl").read_text()
    assert "jax.ffi.include_dir()" in bzl and "import nvidia.nvshmem" in bzl
    runtime = ast.parse((ROOT / "jax_ep" / "runtime.py").read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == "extension" for n in runtime.body)
    assert "jax_ep.runtime.extension().__file__" in native
