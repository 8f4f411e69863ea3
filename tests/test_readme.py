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
