"""The README's example runs as written and computes the documented function."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_is_right():
    text = README.read_text()
    example = re.search(r"## Example\s+```python\n(.*?)```", text, re.S).group(1)
    assert len(example.strip().splitlines()) <= 22, "keep the README example about 20 lines"
    scope: dict = {}
    exec(compile(example, str(README), "exec"), scope)
    out, x, idx, w_gate, w = (np.asarray(scope[k], np.float64)
                              for k in ("out", "x", "topk_idx", "topk_weights", "w"))
    expected = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            expected[t] += w_gate[t, k] * (x[t] @ w[int(idx[t, k])])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    assert scope["mesh"].size == len(jax.devices())
    assert jnp.asarray(scope["out"]).shape == x.shape


def test_readme_example_gets_several_cpu_devices():
    """Run as a script on a machine without a GPU and without any flag, the example's mesh has 8 CPU
    devices (its use_virtual_cpu_devices line), not 1."""
    import os
    import subprocess
    import sys

    example = re.search(r"## Example\s+```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "use_virtual_cpu_devices" in example
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    code = example + "\nprint('mesh', mesh.size, jax.devices()[0].platform, out.shape)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "mesh 8 cpu (1024, 256)" in out.stdout, out.stdout


def test_install_says_whether_the_extension_was_built():
    """`make install` (under `make demo` / `make test`) prints, after pip, one line saying whether the
    CUDA extension jax_ep._C was built, and why not (README: "it says which in one line")."""
    import subprocess
    import sys

    from jax_ep import runtime

    makefile = (README.parent / "Makefile").read_text()
    code = re.search(r"^EXT_STATUS := (.*)$", makefile, re.M).group(1)
    recipe = makefile.split("$(VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("pip install -q -c constraints.txt") < recipe.index('$(PY) -c "$(EXT_STATUS)"')
    assert "$" not in code and '"' not in code                  # survives make and the shell's quotes

    def line(prefix=""):
        out = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.splitlines()) == 1, out.stdout
        return out.stdout.strip()

    built = "jax_ep: CUDA extension jax_ep._C built; backend cuda needs an NVIDIA GPU at run time "
    if runtime.extension_error() is None:
        usable = "(one is usable here)" if runtime.available()[0] else \
            "(none usable here: the pure-JAX reference backend runs)"
        assert line() == built + usable, line()
    else:
        why = " ".join(runtime.extension_error().split())
        assert line() == f"jax_ep: CUDA extension jax_ep._C not built ({why}): the pure-JAX reference " \
                         "backend runs"
    # an import error of several lines (as without nvcc, or with a broken build) still gives one line
    fake = "import jax_ep.runtime; jax_ep.runtime._IMPORT_ERROR = 'no module _C\\nsecond line'; "
    assert line(fake) == ("jax_ep: CUDA extension jax_ep._C not built (no module _C second line): "
                          "the pure-JAX reference backend runs")
    # built, on a machine without a GPU (as the CPU dev machine with nvcc): not "usable on NVIDIA GPUs"
    built_here = "import jax_ep.runtime; jax_ep.runtime._IMPORT_ERROR = None; "
    no_gpu = built_here + "jax_ep.runtime.available = lambda: (False, 'no CUDA device'); "
    assert line(no_gpu) == built + "(none usable here: the pure-JAX reference backend runs)"
    gpu = built_here + "jax_ep.runtime.available = lambda: (True, ''); "
    assert line(gpu) == built + "(one is usable here)"


def test_readme_restore_example_has_its_own_output_folder():
    """The README's --restore command gives the restored run its own --out: without one it would write
    its metrics and plot into the folder of the run that saved the checkpoint (train_moe.py's default
    train_moe_out/, the --out of the README's training command)."""
    text = README.read_text()
    command = r"(?:^|`)((?:[A-Z_]+=\S+ )*python examples/train_moe\.py[^`\n]*)"   # in a code block or `...`
    commands = [" ".join(c.split()) for c in re.findall(command, text, re.M)]
    restores = [c for c in commands if "--restore" in c]
    others = [c for c in commands if "--restore" not in c]
    assert restores and others, commands

    def out(command):
        found = re.search(r"--out (\S+)", command)
        return found.group(1) if found else "train_moe_out"   # train_moe.py's default

    saved = {out(c) for c in others}
    assert "train_moe_out" in saved
    for command in restores:
        assert "--out " in command and out(command) not in saved, command
    savers = [c for c in others if "--save" in c]   # the checkpoint the restore reads is the one saved
    assert savers and {re.search(r"--save (\S+)", c).group(1) for c in savers} == {
        re.search(r"--restore (\S+)", c).group(1) for c in restores}, commands


def test_docs_kernel_config_defaults_match_the_code():
    """docs/api.md's KernelConfig paragraph gives every field's default as the code has it (it said
    num_sms=24; the default is None: every SM but one)."""
    import ast
    import dataclasses

    from jax_ep.config import KernelConfig

    api = (README.parent / "docs" / "api.md").read_text()
    paragraph = api.split("`KernelConfig` (`jax_ep.KernelConfig`", 1)[1].split("Tuned on H200", 1)[0]
    documented = dict(re.findall(r"`(\w+)=([^`]+)`", paragraph))
    defaults = {f.name: f.default for f in dataclasses.fields(KernelConfig)}
    assert documented and set(documented) <= set(defaults), documented
    assert {k: ast.literal_eval(v) for k, v in documented.items()} == {k: defaults[k] for k in documented}


def _pytest_selection(recipe: str) -> set[tuple[bool, bool]]:
    """The (gpu, slow) marker combinations a Makefile recipe's `pytest -m EXPR` selects (all four without
    -m: pyproject's addopts then leaves out gpu, but a recipe must say what it runs)."""
    found = re.search(r"-m pytest\b.*?-m '([^']+)'", recipe)
    assert found, recipe
    expression = found.group(1)
    assert set(re.findall(r"[a-z_]+", expression)) <= {"gpu", "slow", "and", "or", "not"}, expression
    return {(gpu, slow) for gpu in (False, True) for slow in (False, True)
            if eval(expression, {}, {"gpu": gpu, "slow": slow})}


def test_make_test_is_the_fast_suite_and_ci_runs_it(pytestconfig):
    """Issue 39: `make test` (the README's test command) leaves out the tests marked slow, `make
    test-slow` runs only those and `make test-all` both; .ci/run calls the README's command only (.ci/run
    says why); the README gives both commands with their
    durations on 2 CPU cores.
    (Before: `make test` ran everything, 54 min on the 2-core machine, and there was no slow marker.)"""
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
    makefile = (README.parent / "Makefile").read_text()

    def recipe(target):
        found = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M)
        assert found, f"no make target {target}"
        return found.group(1)

    cpu_fast, cpu_slow = (False, False), (False, True)
    selects = {t: _pytest_selection(recipe(t)) for t in ("test", "test-slow", "test-all")}
    assert selects == {"test": {cpu_fast}, "test-slow": {cpu_slow}, "test-all": {cpu_fast, cpu_slow}}, selects

    ci = (README.parent / ".ci" / "run").read_text()
    targets = re.findall(r"^make (test[\w-]*)\s*$", ci, re.M)
    assert targets == ["test"], targets

    paragraphs = [" ".join(p.split()) for p in README.read_text().split("\n\n")]
    for command in ("make test", "make test-all"):   # with its duration, in the same sentence
        said = [p for p in paragraphs if re.search(rf"{command}(?![\w-])[^.]*?\d+ min", p)]
        assert said, command


def test_make_test_covers_every_public_op_and_the_emulator_smoke_cases():
    """The fast suite (`make test`'s selection) still calls every public op of jax_ep (named in a selected
    test or in a function of its module that it reaches) and runs the kernel emulator's smoke cases, the
    backend="cuda" lowering on CPU and the auto backend's resolution."""
    import ast
    import inspect
    import subprocess
    import sys

    import jax_ep

    root = README.parent
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "not gpu and not slow", "tests"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    selected = [line.split("::") for line in out.stdout.splitlines() if "::" in line]
    tests: dict[str, set[str]] = {}
    for path, name, *_ in selected:
        tests.setdefault(path, set()).add(name.split("[")[0])
    named = set()
    for path, names in tests.items():
        module = ast.parse((root / path).read_text())
        defs = {d.name: d for d in module.body if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
        todo, done = list(names), set()
        while todo:                      # the test and the module's functions it reaches
            name = todo.pop()
            if name in done or name not in defs:
                continue
            done.add(name)
            here = {n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)} | {
                n.attr for n in ast.walk(defs[name]) if isinstance(n, ast.Attribute)}
            named |= here
            todo.extend(here & set(defs))
    ops = [name for name in jax_ep.__all__ if inspect.isfunction(getattr(jax_ep, name))]
    assert {"dispatch", "combine", "ll_dispatch", "dispatch_hierarchical", "grouped_matmul"} <= set(ops)
    assert [op for op in ops if op not in named] == []
    for path, name in [("tests/test_kernel_emulator.py", "test_kernel_emulator_smoke"),
                       ("tests/test_native_cpu.py", None), ("tests/test_auto_table.py", None),
                       ("tests/test_hierarchical.py", "test_cuda_backend_lowers_each_stage_on_its_own_axis"),
                       ("tests/test_rank_mask.py", "test_cuda_backend_lowers_the_mask_as_an_operand")]:
        assert path in tests and (name is None or name in tests[path]), (path, name)
