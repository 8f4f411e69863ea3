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

    if runtime.extension_error() is None:
        assert line().startswith("jax_ep: CUDA extension jax_ep._C built"), line()
    else:
        why = " ".join(runtime.extension_error().split())
        assert line() == f"jax_ep: CUDA extension jax_ep._C not built ({why}): the pure-JAX reference " \
                         "backend runs"
    # an import error of several lines (as without nvcc, or with a broken build) still gives one line
    fake = "import jax_ep.runtime; jax_ep.runtime._IMPORT_ERROR = 'no module _C\\nsecond line'; "
    assert line(fake) == ("jax_ep: CUDA extension jax_ep._C not built (no module _C second line): "
                          "the pure-JAX reference backend runs")
