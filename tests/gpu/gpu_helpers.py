"""Helpers of the GPU tests (imported as a top-level module: pytest puts tests/gpu on sys.path)."""

from __future__ import annotations

import jax
import numpy as np

POISON_WORD = 0xA5A5A5A5


def poison_device_memory(devices, nbytes: int = 64 << 20) -> None:
    """Fills nbytes on each device with 0xA5 and frees it: XLA's allocator hands that memory out
    again, so outputs start as garbage."""
    host = np.full(nbytes // 4, POISON_WORD, np.uint32)
    arrays = [jax.device_put(host, d) for d in devices]
    for a in arrays:
        a.block_until_ready()
    del arrays


def handler_stats(target: str) -> dict:
    """{'calls', 'captured_calls'} of an FFI handler so far (jax_ep._C.handler_stats)."""
    from jax_ep import runtime

    return dict(runtime.extension().handler_stats()[target])


def assert_captured(target: str, before: dict, graph_mode: str, options: dict) -> None:
    """With min graph size 1, XLA must have run the handler under stream capture (a CUDA graph).
    (Measured with jax 0.11.2: the default options capture the scan bodies too; with WHILE in the
    command types XLA captured peer_smoke but ran the layout handler outside a graph, so only the
    'graphs' mode asserts.)"""
    after = handler_stats(target)
    print(f"{target} {graph_mode}: handler stats {before} -> {after}")
    if graph_mode == "graphs":
        assert after["captured_calls"] > before["captured_calls"], (
            f"XLA never captured {target} into a CUDA graph with {options}: {before} -> {after}")


# Compile options of the CUDA-graph variants: XLA captures sequences of >= 5 commands by default;
# 1 makes it capture the EP call itself, and WHILE turns a whole lax.scan into one graph.
GRAPH_OPTIONS = {
    "default": {},
    "graphs": {"xla_gpu_graph_min_graph_size": 1},
    "graph_while": {"xla_gpu_graph_min_graph_size": 1,
                    "xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,WHILE"},
}
