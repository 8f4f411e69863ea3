"""jax_ep's benchmarks (not part of the library): the ops (``benchmarks.ops``) and the MoE layer's
training step (``benchmarks.layer``), against plain-JAX baselines (``benchmarks.baselines``).

    python -m benchmarks            # dispatch/combine: table, JSON records (--out)
    python -m benchmarks --layer    # the MoE layer step: table, JSON records; plot with tools/plot_bench.py

Run from the repository root (the package is not installed with jax_ep). ``--help`` lists the options,
``--layer --help`` and ``--low-latency --help`` those of the other modes. Exit status: 0 when every requested
point was measured, 1 when one failed or nothing was measured, 2 on a bad argument.
"""
