"""The benchmark CLI (python -m benchmarks) runs on CPU virtual devices and writes the documented record
format."""

import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeGPUs, parametrize_slow_tail

from benchmarks import layer as bench_layer
from benchmarks import ops as bench

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIELDS = {"op", "backend", "layout", "dtype", "tokens_per_rank", "hidden", "topk", "num_experts", "ep_size",
          "us", "device_us", "logical_gbps", "wire_gbps", "pct_of_peak", "num_sms", "device", "date",
          "measured"}


def test_bench_writes_records(tmp_path):
    out = tmp_path / "bench.json"
    records = bench.main(["--preset", "small", "--tokens", "32", "--dtypes", "bfloat16,float8_e4m3fn",
                          "--backends", "reference", "--iters", "2", "--repeats", "1",
                          "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(records))
    # one combine record per shape (timed on a bf16 dispatch's handle, which it names), a dispatch per dtype
    assert sorted((r["op"], r["dtype"]) for r in saved) == [
        ("broadcast", "bfloat16"), ("broadcast_in_place", "bfloat16"), ("combine", "bfloat16"),
        ("combine_bwd", "bfloat16"), ("combine_bwd_in_place", "bfloat16"), ("dispatch", "bfloat16"),
        ("dispatch", "float8_e4m3fn"), ("layout", "bfloat16"), ("slot_values", "bfloat16")]
    assert [r["dispatch_dtype"] for r in saved if r["op"] == "combine"] == ["bfloat16"]
    for r in saved:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["us"] > 0
        if r["op"] in ("layout", "slot_values"):  # no rows move
            assert r["logical_gbps"] is None and r["wire_gbps"] is None
            continue
        assert r["logical_gbps"] > 0 and r["wire_gbps"] > 0
        assert r["logical_gbps"] >= r["wire_gbps"]  # wire counts only the rows that leave the rank
        assert r["ep_size"] == 8 and r["tokens_per_rank"] == 32
        assert r["layout"] == "expert_major" and r["measured"] is True


LAYER_FIELDS = {"op", "step_ms", "roofline_ms", "gemm_ms", "gemm_tflops", "split_ms", "backend", "gemm",
                "hidden", "ffn_hidden", "num_experts", "topk", "tokens_per_rank", "ep_size", "device", "date",
                "gate_weights"}


@pytest.mark.slow
def test_layer_bench_writes_records(tmp_path):
    out = tmp_path / "layer.json"
    records = bench.main(["--layer", "--layer-shapes", "small", "--iters", "1", "--repeats", "1",
                          "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    assert [r["config"] for r in records] == ["jax_ep", "ep_reference", "plain_jax"]  # no ep_cuda on CPU
    for r in records:
        assert LAYER_FIELDS <= set(r), LAYER_FIELDS - set(r)
        assert r["op"] == "moe_layer" and r["gemm"] == "ragged_dot"   # no Hopper GPU here
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["ep_size"] == 8
        # what ran, with auto's reason where it took the reference (no kernel on CPU)
        assert r["ep_ops"].startswith("dispatch: reference (") and "combine: reference (" in r["ep_ops"]
    assert records[1]["backend"] == "reference" and {r["gate_weights"] for r in records} == {"experts"}
    assert "backend='auto'" in records[0]["ep_ops"] and "backend='auto'" not in records[1]["ep_ops"]


def test_layer_records_carry_their_clocks_and_weight_floor(tmp_path, capsys):
    """A layer record holds the SM clock and power of its timings (benchmarks.clocks; a fake NVML here) and
    the bytes of weights a step must move, as a floor at the copy bandwidth measured in the same run."""
    from benchmarks import clocks

    gpus = FakeGPUs(1455.0)
    with clocks.sampling(read=gpus, period_s=0.0005):
        [r] = bench.main(["--layer", "--layer-shapes", "small", "--layer-configs", "jax_ep", "--iters", "3",
                          "--repeats", "3", "--out", str(tmp_path / "layer.json")])
    assert set(r["clocks"]) == {"step", "gemm", "roofline"}
    for part in r["clocks"].values():
        assert part["sm_mhz"] == [1455.0, 1465.0] and part["power_w"] == [500.0, 600.0]
        assert part["samples"] > 0
    assert bench_layer.sm_clocks(r) == "1455/1455/1455"
    assert bench_layer.clock_note(r) == " at 1455 MHz, 500 W"
    out = capsys.readouterr().out
    assert "MHz step/gemm/roof" in out and "1455/1455/1455" in out
    assert "small jax_ep: " in out and " at 1455 MHz, 500 W" in out
    # a part without samples reads "-"; a record without any, nothing
    gemm_only = dict(clocks=dict(step=None, gemm=r["clocks"]["gemm"], roofline=None))
    assert bench_layer.sm_clocks(gemm_only) == "-/1455/-"
    assert bench_layer.sm_clocks(dict(clocks=dict(step=None))) == "" and bench_layer.clock_note({}) == ""
    # small: hidden 256, ffn 128, 16 experts on 8 devices: 2 local experts of w1 [256, 256] and w2 [128, 256]
    assert r["expert_weight_bytes"] == 2 * (256 * 256 + 128 * 256) * 2
    assert r["read_gbps"] > 0
    assert r["weight_floor_ms"] == pytest.approx(3 * r["expert_weight_bytes"] / r["read_gbps"] / 1e6)
    assert "w floor" in out


def test_profiled_chain_carries_its_clock():
    """The profile behind the split marks its chain's window, so a record can say the clock the split ran
    at (it follows a pause for the profiler, so it need not be the sustained step's)."""
    from benchmarks import clocks

    with clocks.sampling(read=FakeGPUs(1830.0), period_s=0.0005):
        with clocks.collect() as c:
            bench_layer.profiled(lambda: (time.sleep(0.01), jnp.arange(4.0) + 1)[1], 3)   # >= 30 ms
        with clocks.collect() as nothing:
            pass
    assert c.summary()["sm_mhz"] == [1830.0, 1840.0] and c.summary()["samples"] > 0
    assert nothing.summary() is None


def test_profiled_chain_after_sustained_load_marks_only_its_timed_steps():
    """profiled_steps with sustain_s: the trace first holds that long of back-to-back calls (and says how
    many), and the window the split's clock is read from covers only the last `iters` calls (a fake NVML
    reading 1830 MHz in the burst and 1365 once sustained); last_steps keeps those steps' events."""
    import types

    from benchmarks import clocks

    gpus, calls, sustained_at = FakeGPUs(1830.0), [], [float("inf")]

    def call():
        calls.append(time.perf_counter())
        if calls[-1] > sustained_at[0]:
            gpus.mhz = 1365.0
        time.sleep(0.005)
        return jnp.arange(4.0) + 1

    call()                                          # compiled before the sustain window starts
    calls.clear()
    sustained_at[0] = time.perf_counter() + 0.1     # the fake clock drops when the sustain window ends
    with clocks.sampling(read=gpus, period_s=0.0005):
        with clocks.collect() as c:
            _, counted = bench_layer.profiled_steps(call, 3, sustain_s=0.1)
    assert len(calls) >= 3 + 3 and (len(calls) - 3) % 3 == 0        # chains of 3 for 0.1 s, then the 3 timed
    assert counted == len(calls)                                     # what last_steps divides by
    assert c.summary()["sm_mhz"] == [1365.0, 1375.0]
    events = [types.SimpleNamespace(start_ns=t) for t in (9, 1, 5, 3, 7, 2, 8, 4, 6, 10)]
    assert [e.start_ns for e in bench_layer.last_steps(events, 5, 2)] == [7, 8, 9, 10]
    uneven = events + [types.SimpleNamespace(start_ns=11)]     # 11 events of 5 steps: the last 2 / 5 of them
    with pytest.warns(UserWarning, match="11 events over 5 steps do not divide"):
        assert [e.start_ns for e in bench_layer.last_steps(uneven, 5, 2)] == [8, 9, 10, 11]
    assert bench_layer.last_steps(events, 2, 2) == events


def test_profiled_steps_under_sustained_load_hold_one_steps_outputs_at_a_time():
    """The sustained chains keep one call's outputs alive at a time, as best_of does (before 2026-12-05
    they held a whole chain's: every step's gradients, 225 GB of DeepSeek-V3's at EP1)."""
    step = jax.jit(lambda a: a * 2)
    a = jnp.ones((1 << 18,), jnp.float32)   # 1 MiB per output
    peak = [0]

    def call():
        out = step(a)
        peak[0] = max(peak[0], sum(x.nbytes for x in jax.live_arrays()) - a.nbytes)
        return out

    jax.block_until_ready(call())
    peak[0] = 0
    bench_layer.profiled_steps(call, 8, sustain_s=0.3)
    assert peak[0] <= 3 * a.nbytes, peak[0] / a.nbytes


def test_best_of_chain_compiles_the_chained_call_before_timing():
    """best_of(chain=True) warms up the chained call too: its first argument, the previous call's output,
    may have another signature than the one given (here a host array; in the decode benchmark the
    dispatch's slots), and before 2026-12-05 that compile fell in the first timed chain (--repeats 1:
    decode experts_ms was the compile)."""
    step = jax.jit(lambda a, b: a * b, donate_argnums=0)
    executables = []

    def fn(a, b):
        out = step(a, b)
        executables.append(step._cache_size())
        return out

    bench_layer.best_of(fn, np.ones((4, 8), np.float32), jnp.ones((4, 8)), iters=2, repeats=1, chain=True)
    assert executables[-3] == executables[-1] == 2, executables   # the timed chain: 2 calls, no compile


def test_the_expert_block_alone_runs_with_its_configs_options(monkeypatch):
    """gemm_ms times the config's own expert block: its SwiGLU, FP8 weight gradient and GEMM SMs (before
    2026-12-05 every config's was the default block)."""
    from jax_ep import gemm_mgpu

    monkeypatch.setattr(gemm_mgpu, "_num_sms", lambda: 132)
    assert bench_layer.block_options(bench_layer.CONFIGS["jax_ep"]) == {}
    assert bench_layer.block_options(bench_layer.CONFIGS["jax_ep_xla_swiglu"]) == {"swiglu_backend": "xla"}
    assert bench_layer.block_options(bench_layer.CONFIGS["jax_ep_fp8_cached_dw8"])["fp8_weight_grad"] is True
    assert bench_layer.block_options(bench_layer.CONFIGS["ep_cuda_async_mb2_free24"]) == {"gemm_num_sms": 108}
    # the plain-JAX peers run XLA's SwiGLU, not jax_ep's kernels
    assert all(bench_layer.CONFIGS[c]["swiglu_backend"] == "xla" for c in bench_layer.PLAIN_JAX)


def test_layer_table_keeps_long_names_and_failures_apart(capsys):
    """Columns widen to their longest entry: a preset name longer than the default width and "out of
    memory" in the step column stay separate fields, and every field lines up under its header."""
    def record(shape, config, step_ms):
        return dict(op="moe_layer", shape=shape, config=config, gemm="mosaic_gpu", ep_ops="cuda", ep_size=1,
                    step_ms=step_ms, peer_out_of_memory=step_ms is None, roofline_ms=12.71,
                    weight_floor_ms=10.49, roofline_ratio=None if step_ms is None else step_ms / 12.71,
                    gemm_tflops=None, gemm_ms=None, split_ms=None, clocks=None)
    long_shape, long_config = "deepseek_e128_and_more", "jax_ep_fp8_cached_gate_in_combine_x"
    bench_layer.print_table([record(long_shape, long_config, 14.73), record(long_shape, "plain_jax", None)])
    header, fast, oom = capsys.readouterr().out.splitlines()[:3]
    assert fast.split()[:6] == [long_shape, long_config, "mosaic_gpu", "cuda", "1", "14.73"]
    assert oom.split()[:8] == [long_shape, "plain_jax", "mosaic_gpu", "cuda", "1", "out", "of", "memory"]
    # right-aligned columns end where their header ends
    for line, value in ((fast, "14.73"), (oom, "out of memory")):
        assert line.index(value) + len(value) == header.index("step ms") + len("step ms")
        assert line.index("12.71") + 5 == header.index("roofline") + len("roofline")


def test_layer_table_gives_gemm_tflops_four_significant_figures(capsys):
    """A CPU run's GEMMs do well under 1 TF/s: before 2026-12-05 the table printed 0 (.0f)."""
    def record(tflops):
        return dict(op="moe_layer", shape="small", config="jax_ep", gemm="ragged_dot", ep_ops="reference",
                    ep_size=8, step_ms=5.0, roofline_ms=1.0, weight_floor_ms=None, roofline_ratio=5.0,
                    gemm_tflops=tflops, gemm_ms=2.0, split_ms=None, clocks=None)
    bench_layer.print_table([record(0.012345), record(712.34), record(1234.5)])
    rows = capsys.readouterr().out.splitlines()[1:4]
    assert [row.split()[9] for row in rows] == ["0.01235", "712.3", "1234"], rows


def test_plain_jax_cudnn_compiles_the_step_with_its_xla_option_and_the_table_takes_the_faster_peer(capsys):
    """plain_jax_cudnn (named only): the plain-JAX step compiled with XLA's cuDNN ragged-dot fusion on; the
    record names the option and counts the fusions XLA made (none on the CPU: XLA's dense expansion), and
    the table's speed-up is over the faster of the plain-JAX peers that ran."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    r = bench_layer.bench_layer(mesh, bench_layer.LAYER_PRESETS["small"], "plain_jax_cudnn", 1, 1, False)
    assert "error" not in r and r["step_ms"] > 0 and r["cudnn_fusions"] == 0
    assert r["compiler_options"] == {"xla_gpu_experimental_use_ragged_dot_fusion": True}
    assert "plain_jax_cudnn" in bench_layer.NAMED_ONLY
    assert set(bench_layer.PLAIN_JAX) <= set(bench_layer.CONFIGS)

    def record(config, step_ms):
        return dict(op="moe_layer", shape="mid", config=config, gemm="mosaic_gpu", ep_ops="cuda", ep_size=1,
                    step_ms=step_ms, peer_out_of_memory=False, roofline_ms=4.0, weight_floor_ms=None,
                    roofline_ratio=None, gemm_tflops=None, gemm_ms=None, split_ms=None, clocks=None)
    capsys.readouterr()
    bench_layer.print_table([record("jax_ep", 5.0), record("plain_jax", 250.0),
                             record("plain_jax_cudnn", 50.0)])
    ours = capsys.readouterr().out.splitlines()[1].split()
    assert ours[1] == "jax_ep" and "10.0x" in ours and "50.0x" not in ours   # 50 / 5, not 250 / 5


def test_weight_floor_counts_what_each_config_must_move():
    W = 1200
    floor = bench_layer.weight_floor_bytes
    assert floor("jax_ep", W) == floor("plain_jax", W) == 3 * W         # read twice, gradient written once
    assert floor("jax_ep_fp8_cached", W) == floor("jax_ep_fp8_cached_dw8", W) == 2 * W   # FP8 reads: W/2 each
    assert floor("jax_ep_fp8", W) is None                               # quantised inside the step
    assert floor("jax_ep_mb2", W) == 2 * W + W // 2                     # per micro-batch: one gradient write


@pytest.mark.slow
def test_hierarchical_layer_bench_runs_as_two_nodes(tmp_path):
    """ep_hier_reference (named only): the 8 devices as 2 nodes of 4, MoE(node_axis=...)."""
    records = bench.main(["--layer", "--layer-shapes", "small", "--layer-configs", "ep_hier_reference",
                          "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "hier.json")])
    [r] = records
    assert r["config"] == "ep_hier_reference" and r["nodes"] == 2 and r["ep_size"] == 8
    assert r["step_ms"] > 0 and "error" not in r and r["gate_weights"] == "combine"


@pytest.mark.slow
def test_fp8_layer_bench_times_the_quantisation_apart_when_cached(tmp_path):
    """jax_ep_fp8 / jax_ep_fp8_cached / jax_ep_fp8_cached_dw8 (named only): the FP8 layer, the same with its
    weights quantised once outside the timed step (MoE.quantize_weights), whose time is recorded apart,
    and that with FP8 weight gradients."""
    records = bench.main(["--layer", "--layer-shapes", "small", "--layer-configs",
                          "jax_ep_fp8,jax_ep_fp8_cached,jax_ep_fp8_cached_dw8", "--iters", "1", "--repeats",
                          "1", "--out", str(tmp_path / "fp8.json")])
    fresh, cached, dw8 = records
    assert fresh["config"] == "jax_ep_fp8" and "quantise_ms" not in fresh
    assert cached["config"] == "jax_ep_fp8_cached" and cached["quantise_ms"] > 0
    assert dw8["config"] == "jax_ep_fp8_cached_dw8" and dw8["quantise_ms"] > 0
    for r in records:
        assert r["step_ms"] > 0 and r["gemm_ms"] > 0 and "error" not in r


@pytest.mark.slow
def test_layer_bench_with_a_shared_expert(tmp_path, monkeypatch):
    """The *_shared presets build the layer with DeepSeek-V3's dense shared expert (the work an exchange on
    another stream can run beside), record its width, and count its GEMMs in the roofline as dense dots."""
    from benchmarks import layer

    rooflines = []
    real = layer.roofline_seconds
    monkeypatch.setattr(layer, "roofline_seconds", lambda *a: rooflines.append(a[:3]) or real(*a))
    records = bench.main(["--layer", "--layer-shapes", "small_shared", "--layer-configs", "jax_ep",
                          "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "shared.json")])
    [r] = records
    hidden, ffn, experts, topk, tokens = layer.LAYER_PRESETS["small_shared"]
    assert r["shared_ffn_hidden"] == layer.SHARED_FFN["small_shared"] > 0 and r["step_ms"] > 0
    assert rooflines == [(tokens * topk, hidden, ffn), (tokens, hidden, layer.SHARED_FFN["small_shared"])]
    # the routed experts' weights as decode's records count them; the floor moves the shared expert's too
    local = experts // len(jax.devices())
    assert r["expert_weight_bytes"] == local * 3 * hidden * ffn * 2
    moved = r["expert_weight_bytes"] + 3 * hidden * layer.SHARED_FFN["small_shared"] * 2
    assert r["weight_floor_ms"] == pytest.approx(3 * moved / r["read_gbps"] / 1e6)
    built, _ = layer.layer_and_tokens(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",)),
                                      layer.LAYER_PRESETS["small_shared"], "jax_ep",
                                      layer.SHARED_FFN["small_shared"])
    assert built.shared is not None
    assert built.shared.w_down.shape == (layer.SHARED_FFN["small_shared"], hidden)


@pytest.mark.slow
def test_decode_layer_bench_with_a_shared_expert(tmp_path):
    """small_decode_shared: the decode forward with the shared expert beside the low-latency ops (the work
    an async exchange can hide behind), its width recorded; the layer's output includes it."""
    from benchmarks import layer

    records = bench.main(["--layer", "--layer-shapes", "small_decode_shared", "--layer-configs",
                          "ep_reference", "--iters", "1", "--repeats", "1",
                          "--out", str(tmp_path / "decode.json")])
    [r] = records
    assert r["op"] == "moe_layer_decode" and r["step_ms"] > 0
    assert r["shared_ffn_hidden"] == layer.SHARED_FFN["small_decode_shared"] > 0
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    shape = layer.LAYER_PRESETS["small_decode_shared"]
    width = layer.SHARED_FFN["small_decode_shared"]
    built, step, args = layer.decode_step(mesh, shape, "ep_reference", width)
    plain, plain_step, plain_args = layer.decode_step(mesh, shape, "ep_reference")
    assert built.shared is not None and plain.shared is None
    # same seed, the shared expert's parameters drawn last: the difference is the shared expert's output
    x = args[1]
    got = np.asarray(step(*args), np.float32) - np.asarray(plain_step(*plain_args), np.float32)
    want = np.asarray(built.shared(x), np.float32)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())


def test_dy_zeroed_config_builds_the_layer_without_dy_in_place():
    """jax_ep_dy_zeroed (named only): the defaults with EPOptions(dy_in_place=False), combine's backward
    writing every row (the same-run comparison of the aliased d y); jax_ep keeps the default."""
    from jax.sharding import Mesh

    from benchmarks import layer

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    built = {config: layer.layer_and_tokens(mesh, layer.LAYER_PRESETS["small"], config)[0]
             for config in ("jax_ep", "jax_ep_dy_zeroed")}
    assert built["jax_ep"].ep.dy_in_place is True and built["jax_ep_dy_zeroed"].ep.dy_in_place is False
    assert built["jax_ep"].ep == dataclasses.replace(built["jax_ep_dy_zeroed"].ep, dy_in_place=True)
    assert "jax_ep_dy_zeroed" in layer.NAMED_ONLY


def test_remat_configs_time_the_rematerialised_step_with_the_plain_steps_values(tmp_path):
    """jax_ep_remat*: the layer under jax.checkpoint with each policy (layer.checkpoint_policy), the
    plain step's loss and gradients (every form reruns the forward's arithmetic as it was; one layer
    without dy_in_place for all, which changes no value); the layer benchmark runs them (named only)
    and records each as a moe_layer step."""
    from flax import nnx
    from jax.sharding import Mesh

    from benchmarks import layer

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    shape = layer.LAYER_PRESETS["small"]
    built, x = layer.layer_and_tokens(mesh, shape, "jax_ep_dy_zeroed")
    graphdef, params, rest = nnx.split(built, nnx.Param, ...)
    want = layer.training_step(graphdef, rest)[0](params, x)
    for config in ("jax_ep_remat", "jax_ep_remat_dispatch", "jax_ep_remat_gate_up"):
        assert config in layer.NAMED_ONLY
        got = layer.training_step(graphdef, rest, layer.CONFIGS[config]["checkpoint"])[0](params, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.abs(np.asarray(b, np.float32)).max() > 0
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5,
                                       atol=1e-6, err_msg=config)
    assert not layer.CONFIGS["jax_ep_remat_gate_up"]["dy_in_place"]
    records = bench.main(["--layer", "--layer-shapes", "small", "--layer-configs",
                          "jax_ep,jax_ep_remat_dispatch", "--iters", "1", "--repeats", "1",
                          "--out", str(tmp_path / "remat.json")])
    assert [r["config"] for r in records] == ["jax_ep", "jax_ep_remat_dispatch"]
    assert all(r["op"] == "moe_layer" and r["step_ms"] > 0 for r in records)


def test_layer_config_with_xla_swiglu():
    """jax_ep_xla_swiglu (named only): the defaults with MoE(swiglu_backend="xla"); jax_ep keeps "auto"."""
    from jax.sharding import Mesh

    from benchmarks import layer

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    built = {config: layer.layer_and_tokens(mesh, layer.LAYER_PRESETS["small"], config)[0]
             for config in ("jax_ep", "jax_ep_xla_swiglu")}
    assert built["jax_ep"].swiglu_backend == "auto" and built["jax_ep_xla_swiglu"].swiglu_backend == "xla"
    assert built["jax_ep"].ep == built["jax_ep_xla_swiglu"].ep and "jax_ep_xla_swiglu" in layer.NAMED_ONLY


def test_gate_in_combine_configs_build_the_layer_with_gate_weights_in_combine():
    """jax_ep_gate_in_combine / jax_ep_fp8_cached_gate_in_combine (named only): jax_ep and jax_ep_fp8_cached
    (EPOptions.gate_weights "auto": in the experts on the flat exchange) with EPOptions(gate_weights=
    "combine"), nothing else changed."""
    from jax.sharding import Mesh

    from benchmarks import layer

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    for base in ("jax_ep", "jax_ep_fp8_cached"):
        config = base + "_gate_in_combine"
        built = {c: layer.layer_and_tokens(mesh, layer.LAYER_PRESETS["small"], c)[0] for c in (base, config)}
        assert built[base].ep.gate_weights == "auto" and built[config].ep.gate_weights == "combine"
        assert built[base].gate_weights == "experts"
        assert built[base].ep == dataclasses.replace(built[config].ep, gate_weights="auto")
        assert built[base].gemm_dtype == built[config].gemm_dtype and config in layer.NAMED_ONLY


@pytest.mark.parametrize("argv,word", [(["--iters", "0"], "--iters: must be a positive integer, got '0'"),
                                       (["--rounds", "0"], "--rounds: must be a positive integer"),
                                       (["--experts", "0"], "--experts: must be a positive integer"),
                                       (["--sustain", "-1"], "--sustain: must be a number of seconds"),
                                       (["jax_ep"], "configs: each once")])
def test_layer_ab_and_profile_layer_refuse_counts_that_break_them(argv, word, capsys):
    """tools/layer_ab.py --iters 0 divided by zero, --rounds 0 wrote a NaN mean, --experts 0 took the
    preset's count, --sustain -1 went through, a config named twice put both copies' timings in one
    record; tools/profile_layer.py --iters 0 raised a NameError (review of 2026-12-05)."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    tools = pathlib.Path(__file__).resolve().parents[1] / "tools"
    spec = importlib.util.spec_from_file_location("layer_ab", tools / "layer_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    with pytest.raises(SystemExit) as exc:
        ab.main(["small", "jax_ep", *argv])
    assert exc.value.code == 2 and word in capsys.readouterr().err
    if argv[0] in ("--iters", "--experts"):
        proc = subprocess.run([sys.executable, str(tools / "profile_layer.py"), "small", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and word in proc.stderr, proc.stderr


def test_layer_ab_times_each_config_in_alternating_rounds(tmp_path, monkeypatch):
    """tools/layer_ab.py: every configuration compiled once and timed once per round, the order flipped
    every other round, one record each with its rounds and their mean."""
    import importlib.util
    import json
    import pathlib

    from benchmarks import layer as bench_layer

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "layer_ab.py"
    spec = importlib.util.spec_from_file_location("layer_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    order = []
    real = bench_layer.best_of

    def timed(step, *args, **kw):
        order.append(args[0] is not None and step)
        return real(step, *args, **kw)

    monkeypatch.setattr(bench_layer, "best_of", timed)
    out = tmp_path / "ab.json"
    records = ab.main(["small", "jax_ep", "jax_ep_gate_in_combine", "--rounds", "3", "--sustain", "0",
                       "--iters", "1", "--repeats", "1", "--out", str(out)])
    assert [r["config"] for r in records] == ["jax_ep", "jax_ep_gate_in_combine"]
    assert [r["gate_weights"] for r in records] == ["experts", "combine"]
    assert all(len(r["rounds_ms"]) == 3 and r["mean_ms"] > 0 for r in records)
    assert len(order) == 6 and order[0] is order[3] is order[4] and order[1] is order[2] is order[5]
    assert order[0] is not order[1]
    assert json.loads(out.read_text()) == records


FUSED_ACROSS_SCOPES = """\
%fused_add (param_0: bf16[8,4], param_1: bf16[64,4], param_2: s32[8]) -> bf16[8,4] {
  %param_1 = bf16[64,4]{1,0} parameter(1), metadata={scheduling_name="param_1"}
  %convert.2 = f32[64,4]{1,0} convert(%param_1), metadata={op_name="bwd/moe_dispatch/convert"}
  %gather.3 = f32[8,4]{1,0} gather(%convert.2, %param_2), metadata={op_name="bwd/moe_dispatch/gather"}
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %convert.4 = f32[8,4]{1,0} convert(%param_0), metadata={op_name="bwd/moe_router/convert"}
  ROOT %add.5 = bf16[8,4]{1,0} add(%convert.4, %gather.3), metadata={op_name="bwd/moe_router/add_any"}
}

%fused_slice (param_0.9: s32[16]) -> (s32[17], s32[17]) {
  %param_0.9 = s32[16]{0} parameter(0)
  ROOT %concatenate.1 = s32[17]{0} concatenate(%param_0.9), metadata={op_name="fwd/moe_experts/concatenate"}
}

%fused_loss (param_0.3: bf16[512,64], param_1.3: f32[2]) -> f32[] {
  %param_0.3 = bf16[512,64]{1,0} parameter(0)
  %convert.6 = f32[512,64]{1,0} convert(%param_0.3), metadata={op_name="fwd/convert_element_type"}
  %convert.7 = f32[2]{0} convert(%param_1.3), metadata={op_name="fwd/moe_combine/convert"}
  ROOT %reduce.8 = f32[] reduce(%convert.6, %convert.7), metadata={op_name="fwd/reduce_sum"}
}

ENTRY %main.7 (x: bf16[8,4], dy: bf16[64,4], rows: s32[8]) -> bf16[8,4] {
  %x = bf16[8,4]{1,0} parameter(0)
  %gemm_fusion_dot = bf16[8,4]{1,0} fusion(%x), kind=kCustom, metadata={op_name="fwd/moe_router/dot_general"}
  %loop_slice_fusion.1 = (s32[17]{0}, s32[17]{0}) fusion(%rows), kind=kLoop, calls=%fused_slice
  %copy.8 = bf16[8,4]{1,0} copy(%x)
  %loss_fusion = f32[] fusion(%y, %z), kind=kInput, calls=%fused_loss, metadata={op_name="fwd/reduce_sum"}
  %nested = ((s32[2]{0}, f32[]), bf16[8,4]{1,0}) tuple(%a, %b), metadata={op_name="fwd/moe_router/tuple"}
  ROOT %loop_add_fusion = bf16[8,4]{1,0} fusion(%gemm_fusion_dot, %dy, %rows), kind=kLoop, \
calls=%fused_add, metadata={op_name="bwd/moe_router/add_any"}
}
"""


def test_hlo_scopes_gives_a_fusion_its_dominant_scope():
    """A fusion's time goes to the scope whose instructions in its body output the most elements, not to
    its root's: the reference dispatch's backward fused into the router's gradient add counts as dispatch;
    a fusion without metadata of its own takes its body's; an instruction keeps its own op_name."""
    from benchmarks import layer

    scopes = layer.hlo_scopes(FUSED_ACROSS_SCOPES)
    assert "moe_dispatch" in scopes["loop_add_fusion"]
    assert scopes["gemm_fusion_dot"] == "fwd/moe_router/dot_general"
    assert "moe_experts" in scopes["loop_slice_fusion.1"]
    assert "copy.8" not in scopes and "convert.2" in scopes   # no metadata, no scope
    # work named outside the layer's scopes (a loss) outweighs a tiny scoped piece: the fusion keeps its own
    assert scopes["loss_fusion"] == "fwd/reduce_sum"
    assert scopes["nested"] == "fwd/moe_router/tuple"
    assert layer._hlo_instructions(FUSED_ACROSS_SCOPES)["main.7"][-2][:2] == ("nested", 2 + 1 + 32)
    # with only the router's scope counted, the add stays the router's
    assert "moe_router" in layer.hlo_scopes(FUSED_ACROSS_SCOPES, scopes=("moe_router",))["loop_add_fusion"]


@pytest.mark.slow
def test_decode_layer_bench_writes_records(tmp_path):
    records = bench.main(["--layer", "--layer-shapes", "small_decode", "--layer-configs", "ep_reference",
                          "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "decode.json")])
    [r] = records
    assert r["op"] == "moe_layer_decode" and r["config"] == "ep_reference" and r["tokens_per_rank"] == 16
    assert r["step_ms"] > 0 and r["experts_ms"] > 0 and r["experts_einsum_ms"] > 0
    assert r["expert_weight_bytes"] == 2 * (16 // 8) * 3 * 256 * 128
    assert r["ep_ops"].startswith("ll_dispatch: reference (") and "ll_combine: reference (" in r["ep_ops"]


def test_decode_layer_bench_runs_fp8_cached_weights(tmp_path, monkeypatch):
    """jax_ep_fp8_cached on a decode shape: the decode experts in FP8 from weights quantised once; with
    --sustain every timing (the step, the experts grouped and as an einsum) runs at least that long of
    calls first, and the record says so."""
    from benchmarks import layer as bench_layer

    sustained = []
    real = bench_layer.best_of
    monkeypatch.setattr(bench_layer, "best_of", lambda fn, *a, **k: sustained.append(k["sustain_s"]) or
                        real(fn, *a, **k))
    [r] = bench.main(["--layer", "--layer-shapes", "small_decode", "--layer-configs", "jax_ep_fp8_cached",
                      "--iters", "1", "--repeats", "1", "--sustain", "0.01",
                      "--out", str(tmp_path / "decode.json")])
    assert "error" not in r and r["step_ms"] > 0 and r["experts_ms"] > 0
    assert r["sustain_s"] == 0.01 and sustained == [0.01] * 3


@pytest.mark.parametrize("chain", [False, True])
def test_best_of_sustains_the_load_before_timing(chain):
    """best_of(sustain_s=S) runs back-to-back chains for S seconds before the timed ones (the clocks of
    sustained load), chaining the output into the next call as the timed chains do; S=0 adds no call."""
    from benchmarks.layer import best_of

    calls = []

    def fn(x, y):
        calls.append(float(x))
        time.sleep(0.002)
        return x + y if chain else x

    one = jax.numpy.float32(1)
    warm = 2 if chain else 1    # the warm-up: one call, and one chained call (its own signature)
    assert best_of(fn, one, one, iters=3, repeats=2, chain=chain) > 0.002
    assert len(calls) == warm + 3 * 2
    calls.clear()
    start = time.perf_counter()
    best_of(fn, one, one, iters=3, repeats=2, chain=chain, sustain_s=0.05)
    assert time.perf_counter() - start >= 0.05
    # at least one sustaining chain (the elapsed time above says they ran for S; a count of calls per S
    # failed on loaded CI machines, where a 2 ms sleep can take 25)
    assert len(calls) >= warm + 3 + 3 * 2 and (len(calls) - warm) % 3 == 0
    # chained: each call got the previous call's output, through the sustaining chains too
    assert calls == (list(range(1, len(calls) + 1)) if chain else [1.0] * len(calls))


def test_cli_help():
    """`python -m benchmarks --help` from the repository root lists the op and the layer options, says
    how to run it and gives every option's default."""
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m benchmarks "), out.stdout[:200]
    for flag in ("--preset", "--tokens", "--backends", "--num-sms", "--pull", "--profile", "--layer",
                 "--low-latency", "--rank-major", "--out"):
        assert flag in out.stdout, flag
    # the layer's options are in its own help (the ops' docstring above the options names one in a command)
    assert "--layer-shapes" not in out.stdout.split("options:", 1)[1] and "--layer --help" in out.stdout
    options = " ".join(out.stdout.split("options:", 1)[1].split())   # one line, single spaces
    for default in ("(default: auto)", "(default: bfloat16,float8_e4m3fn)", "(default: reference,dense,",
                    "(default: 10)", "(default: 5)", "(default: the presets')",
                    f"(default: {bench.OUT_DIR}/"):
        assert default in options, default


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _options(text: str) -> str:
    """The options part of a --help text (after the description)."""
    return text.split("\noptions:\n", 1)[1]


def test_each_mode_help_lists_its_own_options(capsys):
    """`--layer --help` and `--low-latency --help` show their mode's options (not the ops' text)."""
    layer = _help(capsys, "--layer")
    assert layer.startswith("usage: python -m benchmarks [-h] --layer ")
    assert "MoE layer benchmark" in layer
    for flag in ("--layer-shapes", "--layer-configs", "--iters", "--repeats", "--out", "--profile",
                 "(default: 10)", f"{bench.OUT_DIR}/{bench.DEFAULT_OUT['layer']}"):
        assert flag in layer, flag
    for flag in ("--preset", "--tokens", "--backends", "--dtypes", "--num-sms"):   # the ops' options
        assert flag not in _options(layer), flag
    ll = _help(capsys, "--low-latency")
    assert ll.startswith("usage: python -m benchmarks [-h] --low-latency ")
    assert "ll_dispatch" in ll and f"(default: {bench.LL_TOKENS})" in " ".join(ll.split())
    for flag in ("--tokens", "--dtypes", "--backends", "--iters", "--repeats", "--out", "--profile"):
        assert flag in ll, flag
    for flag in ("--preset", "--layer-shapes", "--num-sms", "--hidden"):
        assert flag not in _options(ll), flag
    ops = _help(capsys)
    assert ops != layer and "--layer-shapes" not in _options(ops) and "--preset" in _options(ops)
    assert _help(capsys, "--rank-major") == ops    # an ops variant: the ops' options


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "0"], "argument --tokens: must be comma-separated positive integers, got '0'"),
    (["--tokens", "32,x"], "argument --tokens: must be comma-separated positive integers, got '32,x'"),
    (["--backends", "foo"], "argument --backends: unknown 'foo' in 'foo'; choose from reference, dense, "
                            "ragged, cuda"),
    (["--backends", "reference,"], "argument --backends: unknown ''"),
    (["--dtypes", "float16"], "argument --dtypes: unknown 'float16' in 'float16'; choose from bfloat16, "
                              "float8_e4m3fn"),
    (["--iters", "0"], "argument --iters: must be a positive integer, got '0'"),
    (["--repeats", "0"], "argument --repeats: must be a positive integer, got '0'"),
    (["--repeats", "-3"], "argument --repeats: must be a positive integer, got '-3'"),
    (["--preset", "huge"], "argument --preset: unknown 'huge'"),
    (["--experts", "0"], "argument --experts: must be a positive integer, got '0'"),
    (["--num-sms", "0"], "argument --num-sms: must be comma-separated positive integers"),
    (["--pull", "sometimes"], "argument --pull: invalid choice: 'sometimes'"),
    # shapes jax_ep refuses, which the dense baseline ran (dropping pairs; a broadcasting error)
    (["--experts", "12", "--backends", "dense", "--tokens", "8", "--iters", "1", "--repeats", "1"],
     "error: --experts 12: not divisible by the EP size 8 (the devices); give --experts a multiple of 8"),
    (["--preset", "sparse", "--topk", "9", "--backends", "dense", "--tokens", "8", "--iters", "1",
      "--repeats", "1"], "error: --topk 9 exceeds preset sparse's 8 experts"),
    (["--topk", "16", "--experts", "8", "--backends", "dense", "--tokens", "8", "--iters", "1",
      "--repeats", "1"], "error: --topk 16 exceeds --experts 8"),
    (["--layer", "--iters", "0"], "argument --iters: must be a positive integer, got '0'"),
    (["--layer", "--repeats", "0"], "argument --repeats: must be a positive integer, got '0'"),
    (["--layer", "--layer-shapes", "nope"], "argument --layer-shapes: unknown 'nope'"),
    (["--layer", "--layer-configs", "ep_fast"], "argument --layer-configs: unknown 'ep_fast'"),
    (["--layer", "--sustain", "-1"], "argument --sustain: must be a number of seconds >= 0, got '-1'"),
    (["--layer", "--sustain", "nan"], "argument --sustain: must be a number of seconds >= 0, got 'nan'"),
    (["--sustain", "1"], "unrecognized arguments: --sustain 1"),
    (["--layer", "--tokens", "4"], "unrecognized arguments: --tokens 4 (python -m benchmarks --layer --help"),
    (["--low-latency", "--backends", "dense"], "argument --backends: unknown 'dense' in 'dense'; choose from "
                                               "reference, cuda"),
    (["--low-latency", "--tokens", "0"], "argument --tokens: must be comma-separated positive integers"),
    (["--low-latency", "--repeats", "0"], "argument --repeats: must be a positive integer, got '0'"),
    (["--layer", "--low-latency"], "--layer and --low-latency are separate modes: give one"),
])
def test_cli_refuses_bad_arguments(argv, message, capsys):
    """Arguments that measure nothing (or NaN) are refused before anything runs: exit 2, naming the flag
    and the value."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_exit_status(tmp_path):
    """From the command line: 2 on a bad argument (not 0 after a ZeroDivisionError printed as FAILED), 0
    for a run that measured every point."""
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    bad = run("--iters", "0", "--out", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "argument --iters: must be a positive integer" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad.json").exists()
    good = run("--preset", "small", "--tokens", "16", "--backends", "reference", "--dtypes", "bfloat16",
               "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "good.json"))
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert all(r["us"] > 0 for r in json.loads((tmp_path / "good.json").read_text()))


def test_bench_exits_1_when_nothing_was_measured(tmp_path, capsys):
    """Only backends this machine lacks: the run measures nothing and exits 1 (the file written holds no
    measured record; --low-latency's has DeepEP's published figures)."""
    from jax_ep import runtime

    if runtime.available()[0]:
        pytest.skip("the cuda backend runs here")
    out = tmp_path / "none.json"
    for argv in (["--backends", "cuda", "--preset", "small", "--tokens", "16"],
                 ["--low-latency", "--backends", "cuda", "--tokens", "1"],
                 ["--layer", "--layer-configs", "ep_cuda", "--layer-shapes", "small"]):
        with pytest.raises(SystemExit) as exc:
            bench.main([*argv, "--iters", "1", "--repeats", "1", "--out", str(out)])
        assert exc.value.code == 1, argv
        assert "nothing was measured" in capsys.readouterr().err, argv
        assert not [r for r in json.loads(out.read_text()) if r.get("measured", True)], argv


def test_low_latency_table_leaves_the_device_time_blank_where_not_profiled(tmp_path, monkeypatch, capsys):
    """As the ops table does (before 2026-12-05 it printed "device 0.0 us" without --profile)."""
    def fake(mesh, backend, dtype, tokens, hidden, topk, experts, *args, **kwargs):
        return [dict(op="ll_dispatch", backend=backend, layout="fixed_slots", dtype=dtype,
                     tokens_per_rank=tokens, hidden=hidden, topk=topk, num_experts=experts, ep_size=8,
                     us=12.5, device_us=None, measured=True)]

    monkeypatch.setattr(bench, "bench_low_latency", fake)
    bench.main(["--low-latency", "--backends", "reference", "--dtypes", "bfloat16", "--tokens", "1",
                "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "ll.json")])
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if x.startswith("ll_dispatch    reference")]
    assert line.endswith("12.5 us") and "device" not in line, line
    published = [x for x in out if x.startswith(("ll_dispatch", "ll_combine")) and "reference" not in x]
    assert published and all("device" in x for x in published), out   # DeepEP's: device times


def test_low_latency_run_times_ll_combine_once_and_its_file_feeds_the_auto_table(tmp_path, monkeypatch):
    """ll_combine is bf16 whatever the dispatch's wire: the default --dtypes bfloat16,float8_e4m3fn timed it
    in both passes, and benchmarks.auto_table refused the run's own file (two reference records of one
    point in one run), so the documented `python -m benchmarks.auto_table <records>` failed on it."""
    from benchmarks import auto_table as writer

    passes = []
    real = bench.bench_low_latency

    def spy(mesh, backend, dtype, tokens, *args, **kwargs):
        passes.append((dtype, kwargs.get("combine", True)))
        return real(mesh, backend, dtype, tokens, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_low_latency", spy)
    out = tmp_path / "ll.json"
    bench.main(["--low-latency", "--backends", "reference", "--tokens", "1", "--iters", "1", "--repeats", "1",
                "--out", str(out)])
    assert passes == [("bfloat16", True), ("float8_e4m3fn", False)]
    records = [r for r in json.loads(out.read_text()) if r["backend"] == "reference"]
    assert sorted(r["dtype"] for r in records if r["op"] == "ll_dispatch") == ["bfloat16", "float8_e4m3fn"]
    assert [r["dtype"] for r in records if r["op"] == "ll_combine"] == ["bfloat16"]
    cuda = [dict(r, backend="cuda", us=r["us"] / 2) for r in records]
    points = writer.points_of(records + cuda)            # refused before: two records of one point
    assert [p["dtype"] for p in points[("ll_combine", "fixed_slots")]] == ["bfloat16"]


def test_bench_exits_1_when_a_point_failed(tmp_path, monkeypatch, capsys):
    """A requested point that raises is printed as FAILED, the others' records are written, and the run
    exits 1 naming it; in every mode."""
    real = bench.bench_shape

    def dense_fails(mesh, backend, *args, **kwargs):
        if backend == "dense":
            raise ZeroDivisionError("float division by zero")
        return real(mesh, backend, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_shape", dense_fails)
    out = tmp_path / "ops.json"
    with pytest.raises(SystemExit) as exc:
        bench.main(["--preset", "small", "--tokens", "16", "--backends", "reference,dense", "--dtypes",
                    "bfloat16", "--iters", "1", "--repeats", "1", "--out", str(out)])
    assert exc.value.code == 1
    captured = capsys.readouterr()
    assert "FAILED dense bfloat16 T=16: ZeroDivisionError" in captured.out
    assert "1 requested point(s) failed (dense bfloat16 T=16: ZeroDivisionError)" in captured.err
    saved = json.loads(out.read_text())
    assert saved and {r["backend"] for r in saved} == {"reference"}

    monkeypatch.setattr(bench, "bench_low_latency", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--low-latency", "--backends", "reference", "--dtypes", "bfloat16", "--tokens", "1",
                    "--iters", "1", "--repeats", "1", "--out", str(tmp_path / "ll.json")])
    assert exc.value.code == 1
    assert "failed (reference bfloat16 T=1: ZeroDivisionError)" in capsys.readouterr().err

    from benchmarks import layer as bench_layer

    def unformable(mesh, shape, config, shared_ffn=0):
        raise ValueError("cannot form this layer here")

    monkeypatch.setattr(bench_layer, "layer_and_tokens", unformable)
    monkeypatch.setattr(bench_layer, "roofline_seconds", lambda *a, **k: 1e-3)
    monkeypatch.setattr(bench_layer, "expert_gemm_seconds", lambda *a, **k: 1e-3)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--layer", "--layer-shapes", "small", "--layer-configs", "ep_reference", "--iters", "1",
                    "--repeats", "1", "--out", str(tmp_path / "layer.json")])
    assert exc.value.code == 1
    assert "failed (small ep_reference: cannot form this layer here)" in capsys.readouterr().err
    [r] = json.loads((tmp_path / "layer.json").read_text())
    assert r["step_ms"] is None and r["error"] == "cannot form this layer here"


@pytest.mark.slow
def test_layer_plain_jax_out_of_memory_is_a_result_not_a_failure(tmp_path, monkeypatch, capsys):
    """plain JAX running out of memory (XLA's ragged_dot at DeepSeek-V3 on 2 GPUs) is recorded and
    printed as "out of memory" and the run exits 0; the same error in a jax_ep configuration exits 1."""
    from benchmarks import layer as bench_layer

    real = bench_layer.best_of

    def oom_for_ragged_dot(fn, *args, **kwargs):
        if oom_now[0]:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 112.00GiB.")
        return real(fn, *args, **kwargs)

    oom_now = [False]
    monkeypatch.setattr(bench_layer, "best_of", oom_for_ragged_dot)
    monkeypatch.setattr(bench_layer, "roofline_seconds", lambda *a, **k: 1e-3)
    monkeypatch.setattr(bench_layer, "expert_gemm_seconds", lambda *a, **k: 1e-3)
    monkeypatch.setattr(bench_layer, "read_bytes_per_second", lambda *a, **k: 1e12)
    real_bench = bench_layer.bench_layer

    def bench_with_oom(mesh, shape, config, *args, **kwargs):
        oom_now[0] = config == "plain_jax" or force_all[0]
        return real_bench(mesh, shape, config, *args, **kwargs)

    force_all = [False]
    monkeypatch.setattr(bench_layer, "bench_layer", bench_with_oom)
    out = tmp_path / "layer.json"
    records = bench.main(
        ["--layer", "--layer-shapes", "small", "--layer-configs", "ep_reference,plain_jax", "--iters", "1",
         "--repeats", "1", "--out", str(out)])
    by_config = {r["config"]: r for r in records}
    assert by_config["plain_jax"]["step_ms"] is None and by_config["plain_jax"]["peer_out_of_memory"]
    assert by_config["ep_reference"]["step_ms"] > 0
    assert "out of memory" in capsys.readouterr().out
    force_all[0] = True
    with pytest.raises(SystemExit) as exc:
        bench.main(["--layer", "--layer-shapes", "small", "--layer-configs", "ep_reference", "--iters", "1",
                    "--repeats", "1", "--out", str(tmp_path / "l2.json")])
    assert exc.value.code == 1
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err


def test_plot_bench_help_and_bad_arguments(tmp_path):
    """tools/plot_bench.py --help prints its usage (it raised TypeError); a missing argument is exit 2."""
    tool = str(ROOT / "tools" / "plot_bench.py")
    out = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: plot_bench.py [-h] SRC DST"), out.stdout[:300]
    assert "python tools/plot_bench.py docs/benchmarks/h200x2.json" in out.stdout
    missing = subprocess.run([sys.executable, tool, str(tmp_path / "a.json")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "the following arguments are required: DST" in missing.stderr


def test_default_out_is_git_ignored(tmp_path):
    """Without --out the records go to out/ under the repository root, which git ignores."""
    for name in bench.DEFAULT_OUT.values():
        path = bench.OUT_DIR / name
        assert path.parent == ROOT / "out"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, timeout=60)
        if ignored.returncode == 128:
            pytest.skip("not a git checkout")
        assert ignored.returncode == 0, f"{path} is not git-ignored"
    # write_records makes the folder
    bench.write_records([{"op": "x"}], tmp_path / "new" / "b.json")
    assert json.loads((tmp_path / "new" / "b.json").read_text()) == [{"op": "x"}]


def test_gbps_keeps_significant_digits():
    assert bench.gbps(None) == ""
    assert bench.gbps(0.012345) == "0.01235"        # CPU figures: not 0.0
    assert bench.gbps(1.5) == "1.5" and bench.gbps(123.456) == "123.5" and bench.gbps(4321.7) == "4322"


# ---- the dense (rank-major) baseline: benchmarks.baselines.dense_dispatch / dense_combine ---------------
R, T, H, K, E = 8, 24, 256, 5, 16   # 2 experts per rank and top-5: tokens pick several experts on one rank


def _dense_inputs(seed: int, dtype):
    """x [R, T, H], distinct expert ids per token with unused (-1) slots and some unrouted tokens."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(dtype)
    idx = np.argsort(rng.random((R, T, E)), axis=2)[:, :, :K].astype(np.int32)
    idx = np.where(rng.random(idx.shape) < 0.2, -1, idx)
    idx[:, :2] = -1                                          # tokens that go nowhere
    w = (rng.random((R, T, K)) + 0.1).astype(np.float32)
    return x, idx, w


def _dense_model(payload, idx, w):
    """NumPy: what each rank receives. payload [R, T, ...] (the wire rows)."""
    local = E // R
    rows = np.zeros((R, R * T, *payload.shape[2:]), payload.dtype)
    experts = np.full((R, R * T, K), -1, np.int32)
    weights = np.zeros((R, R * T, K), np.float32)
    counts = np.zeros((R, R), np.int32)
    token_slot = np.full((R, T, R), -1, np.int32)
    for d in range(R):
        for s in range(R):
            j = 0
            for t in range(T):
                on_d = (idx[s, t] >= 0) & (idx[s, t] // local == d)
                if not on_d.any():
                    continue
                rows[d, s * T + j] = payload[s, t]
                experts[d, s * T + j] = np.where(on_d, idx[s, t] % local, -1)
                weights[d, s * T + j] = np.where(on_d, w[s, t], 0.0)
                token_slot[s, t, d] = j
                j += 1
            counts[d, s] = j
    return rows, experts, weights, counts, token_slot


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_dense_dispatch_delivers_the_right_rows(dtype):
    from helpers import assert_bits_equal, per_rank

    from benchmarks import baselines
    from jax_ep.fp8 import quantize_fp8

    x, idx, w = _dense_inputs(1, np.float32 if dtype == "float8_e4m3fn" else jnp.dtype(dtype))
    wire = None if dtype == "float32" else dtype
    d = per_rank(lambda x, i, w: baselines.dense_dispatch(x, i, w, E, "ep", wire), R)(x, idx, w)
    d = jax.tree.map(np.asarray, d)
    if dtype == "float8_e4m3fn":
        q, scales = jax.tree.map(np.asarray, jax.jit(quantize_fp8)(x.reshape(R * T, H)))
        payload, want_scales = q.reshape(R, T, H), _dense_model(scales.reshape(R, T, -1), idx, w)[0]
        assert_bits_equal(d.scales, want_scales, "scales")
    else:
        payload = x
        assert d.scales is None
    rows, experts, weights, counts, token_slot = _dense_model(payload, idx, w)
    assert_bits_equal(d.x, rows, "rows")          # unused rows included: zeros
    assert_bits_equal(d.local_experts, experts, "local expert ids")
    assert_bits_equal(d.weights, weights, "weights")
    assert_bits_equal(d.recv_counts, counts, "recv_counts")
    assert_bits_equal(d.handle.token_slot, token_slot, "handle.token_slot")
    assert counts.sum() > 0 and (counts < T).any()  # the inputs exercise packing and padding


@parametrize_slow_tail("dtype,rtol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_dense_round_trip_matches_reference_combine(dtype, rtol):
    """combine(dispatch(x)) with a per-row value (each rank's gate-weighted sum of expert-specific
    scalings of the row, unused rows poisoned with NaN) equals jax_ep's reference combine of the same
    expert outputs, and the exact result x · Σ_k w_k c[e_k]."""
    from helpers import assert_close_f, per_rank

    from benchmarks import baselines
    from jax_ep.config import EPConfig
    from jax_ep.ops import combine, dispatch

    x, idx, w = _dense_inputs(2, jnp.dtype(dtype))
    scale = np.linspace(0.5, 2.0, E).astype(np.float32)      # expert e multiplies its rows by scale[e]
    local = E // R

    def dense_round_trip(x, i, w):
        d = baselines.dense_dispatch(x, i, w, E, "ep")
        me = jax.lax.axis_index("ep")
        ids = jnp.where(d.local_experts >= 0, me * local + d.local_experts, 0)
        per_row = jnp.sum(d.weights * jnp.asarray(scale)[ids], axis=1)       # 0 for unused slots
        y = (d.x.astype(jnp.float32) * per_row[:, None]).astype(x.dtype)
        used = jnp.arange(T)[None, :] < d.recv_counts[:, None]                # [R_src, T]
        y = jnp.where(used.reshape(-1)[:, None], y, jnp.nan)
        return baselines.dense_combine(y, d.handle, "ep")

    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="reference")

    def reference_round_trip(x, i, w):
        d = dispatch(x, i, w, cfg)
        me = jax.lax.axis_index("ep")
        row_expert = jnp.searchsorted(jnp.cumsum(d.group_sizes), jnp.arange(d.x.shape[0]), side="right")
        row_scale = jnp.asarray(scale)[me * local + jnp.minimum(row_expert, local - 1)]
        return combine((d.x.astype(jnp.float32) * row_scale[:, None]).astype(x.dtype), d.handle, cfg)

    got = np.asarray(per_rank(dense_round_trip, R)(x, idx, w))
    want = np.asarray(per_rank(reference_round_trip, R)(x, idx, w))
    assert got.dtype == x.dtype and np.isfinite(got.astype(np.float32)).all()
    assert_close_f(got, want, rtol, "dense vs reference combine")
    gain = np.sum(np.where(idx >= 0, w * scale[np.maximum(idx, 0)], 0.0), axis=2)
    exact = x.astype(np.float64) * gain[..., None]
    assert_close_f(got, exact, rtol, "dense vs exact")
    assert (got[:, :2] == 0).all()   # unrouted tokens come back as zeros


def test_the_baselines_refuse_experts_the_ep_size_does_not_divide():
    """Before 2026-12-05 dense_dispatch silently dropped every pair of the experts past the last whole
    rank (6 experts on 4 ranks: experts 4 and 5 were no rank's)."""
    from helpers import per_rank

    from benchmarks import baselines

    x, idx, w = _dense_inputs(2, jnp.dtype("bfloat16"))
    for fn in (baselines.dense_dispatch, baselines.ragged_dispatch):
        with pytest.raises(ValueError, match="num_experts=6 is not divisible by the EP size 4"):
            per_rank(lambda x, i, w, fn=fn: fn(x, i, w, 6, "ep").x, 4)(x[:4], idx[:4] % 6, w[:4])
    with pytest.raises(ValueError, match="preset sparse's 8 experts: not divisible by the EP size 16"):
        bench.resolve_shapes("sparse", "gpu", ep_size=16)


def test_resolve_shapes_sweeps_every_preset():
    shapes = bench.resolve_shapes("deepseek,sparse", "gpu", "128,512,2048,4096,8192")
    assert shapes == [(t, 7168, 8, 256) for t in (128, 512, 2048, 4096, 8192)] + [
        (t, 7168, 2, 8) for t in (128, 512, 2048, 4096, 8192)]
    assert bench.resolve_shapes("auto", "gpu") == [(4096, 7168, 8, 256), (4096, 7168, 2, 8)]
    assert bench.resolve_shapes("auto", "cpu", "64", experts=16) == [(64, 512, 4, 16)]
    with pytest.raises(ValueError, match="unknown preset"):
        bench.resolve_shapes("deepseek,nope", "gpu")


def test_published_records_only_for_the_deepseek_shape():
    assert bench.published_records([(4096, 7168, 2, 8), (2048, 7168, 8, 256)], ["bfloat16"]) == []
    recs = bench.published_records([(4096, 7168, 8, 256)], ["bfloat16", "float8_e4m3fn"])
    assert {(r["op"], r["dtype"], r["us"]) for r in recs} == {
        ("dispatch", "bfloat16", 343.0), ("dispatch", "float8_e4m3fn", 244.0), ("combine", "bfloat16", 400.0)}
    for r in recs:
        assert FIELDS <= set(r) and r["measured"] is False and r["layout"] == "rank_major"
        assert r["backend"] == bench.PUBLISHED_BACKEND and r["num_sms"] == 24 and r["ep_size"] == 2
    bench.print_table(recs)   # prints with the empty GB/s columns


@pytest.mark.slow
def test_bench_dense_backend_and_plot(tmp_path, capsys):
    """The dense backend runs on CPU, every record names its layout, and the plot tool draws the file."""
    out = tmp_path / "bench.json"
    records = bench.main(["--preset", "small", "--tokens", "16,32", "--dtypes", "bfloat16",
                          "--backends", "reference,dense", "--iters", "1", "--repeats", "1",
                          "--out", str(out)])
    table = capsys.readouterr().out
    assert {(r["backend"], r["layout"]) for r in records} == {("reference", "expert_major"),
                                                               ("dense", "rank_major")}
    assert all(r["measured"] and r["device_us"] is None for r in records)
    assert "rank_major" in table and "expert_major" in table and "published" not in table
    assert sorted({r["tokens_per_rank"] for r in records}) == [16, 32]
    for r in records:   # the GB/s columns print as in gbps(): 4 significant digits
        if r["logical_gbps"] is not None:
            assert bench.gbps(r["logical_gbps"]) in table and bench.gbps(r["wire_gbps"]) in table
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import plot_bench
    finally:
        sys.path.remove(str(ROOT / "tools"))
    png = tmp_path / "bench.png"
    plot_bench.main(str(out), str(png))
    assert png.stat().st_size > 0


def test_auto_table_from_records(tmp_path):
    """The benchmark's auto table pairs cuda and reference records per op and decides from them."""
    from benchmarks import auto_table as bench_auto_table

    def rec(op, backend, tokens, us, dtype="bfloat16"):
        return dict(op=op, backend=backend, layout="expert_major", dtype=dtype, tokens_per_rank=tokens,
                    hidden=512, topk=4, num_experts=32, ep_size=2, us=us + 1000.0, device_us=us,
                    device="2x H200", measured=True)

    records = [rec("dispatch", "cuda", 128, 50), rec("dispatch", "reference", 128, 40),
               rec("dispatch", "cuda", 4096, 300), rec("dispatch", "reference", 4096, 900),
               rec("combine", "cuda", 128, 10), rec("combine", "reference", 128, 20),
               rec("combine", "cuda", 4096, 100), rec("combine", "reference", 4096, 200),
               rec("combine", "dense", 4096, 1)]  # other backends do not take part
    path = tmp_path / "auto_table.json"
    table = bench_auto_table.write(records, path)
    assert json.loads(path.read_text()) == table
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": 4096}
    assert table["ops"]["combine"]["expert_major"]["min_tokens"] == {"2": 0}
    assert [p["kernel_us"] for p in table["ops"]["combine"]["expert_major"]["points"]] == [10, 100]
    with pytest.raises(ValueError, match="nothing to decide"):
        bench_auto_table.write([rec("combine", "cuda", 128, 10)], path)


def test_auto_table_layer_veto(tmp_path):
    """A layer step slower with the EP kernels vetoes every communicating kernel, not the layout."""
    from benchmarks import auto_table as bench_auto_table

    def rec(op, backend, us):
        return dict(op=op, backend=backend, layout="expert_major", dtype="bfloat16", tokens_per_rank=4096,
                    hidden=512, topk=4, num_experts=32, ep_size=2, us=us, device_us=us, measured=True)

    ops = [rec("dispatch", "cuda", 100), rec("dispatch", "reference", 200),
           rec("layout", "cuda", 5), rec("layout", "reference", 20)]
    faster = [dict(op="moe_layer", shape="mid", config="ep_reference", ep_size=2, step_ms=9.0),
              dict(op="moe_layer", shape="mid", config="ep_cuda", ep_size=2, step_ms=8.0)]
    table = bench_auto_table.write(ops, tmp_path / "a.json", layer_records=faster)
    assert "vetoed" not in table and table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": 0}
    slower = [dict(faster[0]), dict(faster[1], step_ms=9.5)]
    table = bench_auto_table.write(ops, tmp_path / "a.json", layer_records=slower)
    assert "mid" in table["vetoed"]["2"] and "9.50 ms" in table["vetoed"]["2"]
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens"] == {"2": None}
    assert table["ops"]["dispatch"]["expert_major"]["min_tokens_ops"] == {"2": 0}
    assert table["ops"]["layout"]["expert_major"]["min_tokens"] == {"2": 0}
    # within the run-to-run spread of a step (LAYER_TIE) it is a tie: no veto
    tie = [dict(faster[0]), dict(faster[1], step_ms=9.0 * (1 + bench_auto_table.LAYER_TIE) * 0.999)]
    assert "vetoed" not in bench_auto_table.write(ops, tmp_path / "a.json", layer_records=tie)


def test_ll_overlap_record_runs_on_the_reference_path():
    """The two-phase overlap measurement (a GPU record) builds and runs its three programs; on CPU with
    the reference ops, only that it runs and its fields are checked."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ep.config import EPConfig

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    rng = np.random.default_rng(0)
    tokens, hidden, topk, experts = 4, 256, 2, 8
    cfg = EPConfig(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                   backend="reference", dispatch_dtype="bfloat16")
    x = jax.device_put(rng.standard_normal((2 * tokens, hidden)).astype(np.float32).astype(jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    idx, w = (jax.device_put(a, NamedSharding(mesh, P("ep")))
              for a in bench.routing_inputs(rng, 2 * tokens, experts, topk))
    r = bench.ll_overlap(mesh, cfg, (x, idx, w), 1, 1, rng)
    assert r["op"] == "ll_overlap" and r["dtype"] == "bfloat16" and r["backend"] == "reference"
    assert r["shared_ffn"] == bench.LL_OVERLAP_FFN and r["layers"] == bench.LL_OVERLAP_LAYERS
    assert r["us"] > 0 and r["us_serial"] > 0 and r["us_shared"] > 0
    assert r["hidden_us"] == r["us_serial"] - r["us"]
    assert r["dispatch_in_step_us"] == r["us_serial"] - r["us_shared"]
    if r["dispatch_in_step_us"] > 0:
        assert r["hidden_share"] == r["hidden_us"] / r["dispatch_in_step_us"]


@pytest.mark.slow
def test_bench_rank_major_records_feed_the_auto_table(tmp_path):
    """--rank-major: the reference (and cuda, where built) time dispatch_rank_major per dtype and
    combine_rank_major / broadcast_rank_major, with layout rank_major; dense stays the rank-major
    baseline. Paired with cuda records they become the auto table's rank_major rows."""
    from benchmarks import auto_table as bench_auto_table

    out = tmp_path / "bench.json"
    records = bench.main(["--rank-major", "--preset", "small", "--tokens", "32", "--dtypes",
                          "bfloat16,float8_e4m3fn", "--backends", "reference,dense", "--iters", "2",
                          "--repeats", "1", "--out", str(out)])
    mine = sorted((r["op"], r["dtype"], r["layout"]) for r in records if r["backend"] == "reference")
    assert mine == [("broadcast_rank_major", "bfloat16", "rank_major"),
                    ("combine_rank_major", "bfloat16", "rank_major"),
                    ("dispatch_rank_major", "bfloat16", "rank_major"),
                    ("dispatch_rank_major", "float8_e4m3fn", "rank_major")]
    assert {(r["op"], r["layout"]) for r in records if r["backend"] == "dense"} == {
        ("dispatch", "rank_major"), ("combine", "rank_major")}
    for r in records:
        assert FIELDS <= set(r) and r["us"] > 0 and r["wire_gbps"] > 0
    fake_cuda = [dict(r, backend="cuda", device_us=1.0) for r in records if r["backend"] == "reference"]
    table = bench_auto_table.write(records + fake_cuda, tmp_path / "auto_table.json")
    for op in ("dispatch_rank_major", "combine_rank_major", "broadcast_rank_major"):
        assert table["ops"][op]["rank_major"]["min_tokens"] == {"8": 0}, table["ops"][op]


def test_layer_split_says_how_much_ep_time_overlap_hides():
    """ep_hidden_ms: the EP scopes' device time that ran beside other work (device time summed over the
    streams minus the step's span), at most the EP time; 0 when everything runs in series."""
    from benchmarks.layer import hidden_ep_ms

    split = {"router": 0.2, "dispatch": 1.0, "experts": 6.0, "combine": 0.8, "rest": 0.5}   # 8.5 ms
    assert hidden_ep_ms(split, 9.0) == 0.0          # in series, with 0.5 ms of gaps
    assert hidden_ep_ms(split, 7.3) == 1.2          # 1.2 of the 1.8 ms of exchanges beside the GEMMs
    assert hidden_ep_ms(split, 5.0) == 1.8          # never more than the exchanges themselves


def test_kernel_overlap_counts_time_beside_another_from_intervals():
    """kernel_overlap_ms: the kernels' summed time and the time some kernel ran, per step, over device 0's
    stream lines (gaps count in neither; other devices and non-stream lines not at all)."""
    from types import SimpleNamespace as NS

    from benchmarks.layer import kernel_overlap_ms

    def line(name, *spans_us):
        return NS(name=name, events=[NS(name="kernel", start_ns=a * 1000, end_ns=b * 1000)
                                     for a, b in spans_us])

    data = NS(planes=[
        NS(name="/device:GPU:0", lines=[line("Stream #14(Compute)", (0, 10), (20, 25), (30, 40)),
                                        line("Stream #72(Compute)", (5, 15), (21, 22)),
                                        line("XLA Ops", (0, 40))]),
        NS(name="/device:GPU:1", lines=[line("Stream #14(Compute)", (0, 40))])])
    summed, union = kernel_overlap_ms(data, iters=2)   # per step: halves
    assert summed == pytest.approx(36e-3 / 2) and union == pytest.approx(30e-3 / 2)
    assert kernel_overlap_ms(NS(planes=[]), iters=1) == (0.0, 0.0)
    # a trace of 5 steps of which the last one counts (profiled after sustaining): its kernels only
    steps = NS(planes=[NS(name="/device:GPU:0", lines=[
        line("Stream #14(Compute)", *[(100 * i, 100 * i + 10) for i in range(5)]),
        line("Stream #72(Compute)", *[(100 * i + 5, 100 * i + (35 if i == 4 else 6)) for i in range(5)])])])
    summed, union = kernel_overlap_ms(steps, iters=1, calls=5)
    assert summed == pytest.approx(40e-3) and union == pytest.approx(35e-3)


@pytest.mark.slow
def test_overlap_probe_runs_its_three_programs(tmp_path):
    """tools/overlap_probe.py at --small on CPU (lax.ragged_dot, the reference dispatch): each program
    timed and profiled, its HLO dumped; no GPU kernels, so nothing beside anything."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    try:
        import overlap_probe
    finally:
        sys.path.pop(0)
    result = overlap_probe.main(["--small", "--gemm", "ragged", "--iters", "1", "--repeats", "1",
                                 "--dump", str(tmp_path), "--group"])
    assert set(result) == {"gemm", "op", "both"}
    for name, r in result.items():
        assert r["wall_ms"] > 0 and r["beside_ms"] == 0.0, (name, r)
        assert "ENTRY" in (tmp_path / f"{name}.hlo.txt").read_text()
        assert (tmp_path / f"{name}.kernels.txt").read_text() == ""   # no GPU kernels on CPU
    assert "is_scheduled=true" in (tmp_path / "both.hlo.txt").read_text()   # the schedule, not the input
    with pytest.raises(SystemExit):   # an unknown program is an argument error
        overlap_probe.main(["--small", "--programs", "both,gemmm"])
    # --side on CPU: the reference dispatch takes no work, so the GEMM runs after it (same program shape)
    side = overlap_probe.main(["--small", "--gemm", "ragged", "--iters", "1", "--repeats", "1", "--side",
                               "--programs", "both"])
    assert side["both"]["wall_ms"] > 0
    # --sustain: each program timed and profiled after that long of calls; gemm_all: the GEMM on every SM
    sustained = overlap_probe.main(["--small", "--gemm", "ragged", "--iters", "1", "--repeats", "1",
                                    "--sustain", "0.05", "--programs", "gemm_all,gemm,op,both"])
    assert set(sustained) == {"gemm_all", "gemm", "op", "both"}
    assert all(r["wall_ms"] > 0 and r["clocks"] is None for r in sustained.values())   # no NVML here


def test_overlap_probe_kernel_timeline_in_start_order():
    """The probe's timeline: kernels of every stream line of device 0 in start order, µs from the first."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    try:
        import overlap_probe
    finally:
        sys.path.pop(0)
    from types import SimpleNamespace as NS
    ev = lambda name, s, e: NS(name=name, start_ns=s, end_ns=e)  # noqa: E731
    data = NS(planes=[NS(name="/device:GPU:0", lines=[
        NS(name="Stream #14(Compute)", events=[ev("gemm", 1000, 9000)]),
        NS(name="Stream #15", events=[ev("dispatch", 3000, 4000)]),
        NS(name="XLA Ops", events=[ev("custom-call", 0, 10000)])])])
    rows = [line.split() for line in overlap_probe.kernel_timeline(data).splitlines()]
    assert rows == [["0.0", "8.0", "Stream", "#14(Compute)", "gemm"],
                    ["2.0", "1.0", "Stream", "#15", "dispatch"]]


def test_aligned_profile_takes_out_the_aligning_steps_kernels(monkeypatch):
    """On several GPUs each profiled call follows _aligner's step; its kernels leave the sums: a name
    only it runs is dropped, a name the call runs too keeps the call's share (the traces are faked:
    no GPU here). One GPU: no step."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    step_alone = {"gemm": 1500.0, "ncclAllReduce": 600.0, "loop_convert_fusion": 2.0}
    call_alone = {"notify": 20.0, "main": 200.0, "loop_convert_fusion": 1.0}
    steps, traces = [], []

    def fake_trace(calls, iters):
        before = len(steps)
        calls()
        traces.append(len(steps) - before)   # aligning steps the traced calls ran
        if traces[-1] == 0:
            return dict(call_alone)
        aligned = {name: step_alone.get(name, 0.0) + call_alone.get(name, 0.0)
                   for name in {*step_alone, *call_alone}}
        aligned["notify"] = 15.0   # aligned: less waiting for the peer
        return aligned

    monkeypatch.setattr(bench, "_trace_totals", fake_trace)
    monkeypatch.setattr(bench, "_aligner", lambda m: (lambda a: steps.append(a), "a", step_alone))
    spec = jax.sharding.PartitionSpec("ep")
    fn = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=spec, out_specs=spec)
    got = bench.kernel_profile(fn, (jnp.ones((2, 4)),), 5, mesh)
    assert got == {"main": 200.0, "notify": 15.0, "loop_convert_fusion": 1.0}
    assert list(got) == ["main", "notify", "loop_convert_fusion"]   # slowest first
    assert traces == [0, 1] and steps == ["a"]   # the call alone, then aligned calls
    traces.clear()
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    assert bench.kernel_profile(fn, (jnp.ones((2, 4)),), 5, one) == {"main": 200.0, "notify": 20.0,
                                                                        "loop_convert_fusion": 1.0}
    assert traces == [0]


def test_micro_batch_configs_step_two_inputs_in_one_program(tmp_path):
    """jax_ep_mb2 (named only): two micro-batches in one jitted step, their losses summed: the loss and
    every parameter gradient are the sums of the two one-micro-batch steps', each input gets its own
    gradient, and the record's step_ms is per micro-batch. The overlapped forms build the layer with the
    EP kernels on stream 1 with `free` SMs and the expert GEMMs on the GPU's others."""
    from flax import nnx
    from jax.sharding import Mesh

    from benchmarks import layer
    from jax_ep.config import KernelConfig

    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    shape = layer.LAYER_PRESETS["small"]
    built, xs = layer.layer_and_tokens(mesh, shape, "jax_ep_mb2")
    single, x0 = layer.layer_and_tokens(mesh, shape, "jax_ep")
    assert isinstance(xs, tuple) and len(xs) == 2 and not isinstance(x0, tuple)
    np.testing.assert_array_equal(np.asarray(xs[0]), np.asarray(x0))
    assert np.abs(np.asarray(xs[1]) - np.asarray(xs[0])).max() > 0
    assert built.gemm_num_sms is None and "jax_ep_mb2" in layer.NAMED_ONLY
    graphdef, params, rest = nnx.split(built, nnx.Param, ...)
    step, _ = layer.training_step(graphdef, rest)
    loss, (grads, dxs) = step(params, xs)
    parts = [step(params, x) for x in xs]
    np.testing.assert_allclose(float(loss), sum(float(p[0]) for p in parts), rtol=1e-6)
    for got, a, b in zip(jax.tree.leaves(grads), *(jax.tree.leaves(p[1][0]) for p in parts), strict=True):
        want = np.asarray(a, np.float32) + np.asarray(b, np.float32)
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2,
                                   atol=2e-2 * np.abs(want).max())
    for dx, p in zip(dxs, parts, strict=True):
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(p[1][1]))

    records = bench.main(["--layer", "--layer-shapes", "small", "--layer-configs", "jax_ep_mb2", "--iters",
                          "1", "--repeats", "1", "--out", str(tmp_path / "mb2.json")])
    [r] = records
    assert r["micro_batches"] == 2 and r["step_ms"] > 0
    assert r["roofline_ratio"] == r["step_ms"] / r["roofline_ms"]

    for free in (12, 24):   # 132 SMs: the grouped GEMMs' grid off a GPU (gemm_mgpu._num_sms)
        config = f"ep_cuda_async_mb2_free{free}"
        overlapped, xs = layer.layer_and_tokens(mesh, shape, config)
        assert overlapped.gemm_num_sms == 132 - free and len(xs) == 2 and config in layer.NAMED_ONLY
        assert overlapped.ep.kernel == KernelConfig(async_stream=1, num_sms=free)
        assert overlapped.ep.backend == "cuda" and overlapped.ep.chunks == 1
    # the chunked form: one call, each rank's tokens micro-batch 0's then micro-batch 1's (its two chunks)
    chunked, x = layer.layer_and_tokens(mesh, shape, "ep_cuda_async_mb2_chunked_free24")
    assert chunked.ep.chunks == 2 and chunked.gemm_num_sms == 108 and "ep_cuda_async_mb2_chunked_free24" in \
        layer.NAMED_ONLY
    tokens, ranks = shape[4], mesh.size
    per_rank = np.asarray(x).reshape(ranks, 2, tokens, -1)
    for b in range(2):
        np.testing.assert_array_equal(per_rank[:, b], np.asarray(xs[b]).reshape(ranks, tokens, -1))


def test_cuda_records_say_whether_the_rows_were_pulled(monkeypatch):
    """A cuda record's pull is what its op's kernels did in that call: a dispatch (either layout) and
    the ops on its handle follow dispatch_pull, the broadcasts their own knob; pull_setting is the run's
    setting, "auto" for KernelConfig's default (the auto table's choice, asked as the op asks it)."""
    from jax_ep import EPConfig, KernelConfig, auto_table, runtime

    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "process_model", lambda: "local_peers")
    monkeypatch.setattr(runtime, "unreachable_processes", lambda: [])
    monkeypatch.setattr(auto_table, "pull_faster",
                        lambda knob, tokens, ep, sms: knob == "broadcast_pull" and ep == 4)
    cfg = EPConfig(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16)
    fields = {op: bench.pull_fields(op, "dispatch", cfg, 4)
              for op in ("dispatch", "combine", "broadcast", "broadcast_in_place", "combine_bwd")}
    assert fields == {"dispatch": dict(pull=False, pull_setting="auto"),
                      "combine": dict(pull=False, pull_setting="auto"),
                      "broadcast": dict(pull=True, pull_setting="auto"),
                      "broadcast_in_place": dict(pull=True, pull_setting="auto"),
                      "combine_bwd": dict(pull=False, pull_setting="auto")}
    assert bench.pull_fields("broadcast", "dispatch", cfg, 2) == dict(pull=False, pull_setting="auto")
    pulled = cfg.replace(kernel=KernelConfig(dispatch_pull=True, broadcast_pull=True))
    assert bench.pull_fields("combine_rank_major", "dispatch_rank_major", pulled, 2) == dict(
        pull=True, pull_setting="pull")
    assert bench.pull_fields("broadcast_rank_major", "dispatch_rank_major", pulled, 2)["pull"]
    pushed = cfg.replace(kernel=KernelConfig(dispatch_pull=False, broadcast_pull=False))
    assert bench.pull_fields("broadcast_in_place", "dispatch", pushed, 4) == dict(pull=False,
                                                                                pull_setting="push")
