"""The runnable examples: examples/train_moe.py (2-D data x ep mesh, with and without bias balancing)
writes sane metrics and a plot, trains the same as 2 processes (python -m jax_ep.launch), and its
checkpoint restores on 4 devices (another EP size) with the same loss; the demo
(examples/demo.py, `make demo`) trains with falling loss.

All run as subprocesses (each sets jax_num_cpu_devices before JAX starts, which this process cannot
do again), started together so that their compilations overlap.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import run_logged

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, BATCH, SEQ, LAYERS, EXPERTS, TOPK = 8, 16, 32, 1, 16, 2
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--layers", str(LAYERS),
              "--experts", str(EXPERTS), "--mesh", "2,4", "--bias-rate", "0.05"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Runs both commands at once; returns (train_moe output dir, {name: (returncode, log text)})."""
    tmp = tmp_path_factory.mktemp("examples")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    commands = {
        "train_moe": [sys.executable, str(ROOT / "examples" / "train_moe.py"), *TRAIN_ARGS,
                      "--out", str(tmp / "out"), "--save", str(tmp / "ckpt")],
        "demo": [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "6"],
        # the same training as 2 processes x 4 CPU devices (jax.distributed, gloo collectives), its
        # blocks rematerialised (--remat)
        "train_moe_2proc": [sys.executable, "-m", "jax_ep.launch", "--nproc", "2",
                            "--local-devices-per-process", "4", "--timeout", "540",
                            str(ROOT / "examples" / "train_moe.py"), *TRAIN_ARGS,
                            "--out", str(tmp / "out_2proc"), "--remat"],
    }
    # the launched run on CPU devices, on GPU machines too
    return tmp, run_logged(commands, tmp, cwd=tmp, env=env, wait_s=600,
                           env_for={"train_moe_2proc": dict(env, JAX_PLATFORMS="cpu")})


@pytest.mark.slow
def test_train_moe_metrics(finished):
    tmp, results = finished
    out = tmp / "out"
    code, log = results["train_moe"]
    assert code == 0, log
    assert "tokens/s" in log and "imbalance" in log and "dispatch+combine" in log, log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["mesh"] == [2, 4]
    runs = metrics["runs"]
    assert set(runs) == {"no_balancing", "bias_balancing"}
    for name, run in runs.items():
        loss = run["loss"]
        assert len(loss) == STEPS and all(math.isfinite(v) for v in loss), (name, loss)
        assert loss[-1] < 0.8 * loss[0] and np.mean(loss[-3:]) < np.mean(loss[:3]), (name, loss)
        load = np.asarray(run["expert_load"])
        assert load.shape == (STEPS, LAYERS, EXPERTS)                     # per step, layer, expert
        assert np.all(load >= 0) and np.all(load.sum(-1) == BATCH * SEQ * TOPK), name
        assert run["dropped"] == [0] * STEPS
        assert len(run["imbalance"]) == STEPS and all(v >= 1 for v in run["imbalance"])
        assert run["tokens_per_s"] > 0
    # same seed and batches: the first step routes identically (the bias starts at zero)
    np.testing.assert_array_equal(runs["no_balancing"]["expert_load"][0],
                                  runs["bias_balancing"]["expert_load"][0])
    # per-step imbalance is noisy at this size; the load summed over the run is reliably more even
    assert runs["bias_balancing"]["imbalance_total"] < 0.75 * runs["no_balancing"]["imbalance_total"], \
        {name: run["imbalance_total"] for name, run in runs.items()}
    comm = metrics["communication"]
    assert "reference" in comm
    for row in comm.values():
        assert 0 < row["dispatch_combine_s"] and 0 < row["share"] < 1
    from jax_ep import runtime

    usable, reason = runtime.available()
    if "cuda" not in comm and not usable:   # the whole reason, on one line, not its first 120 characters
        line = next(x for x in log.splitlines() if "backend 'cuda': not available here: " in x)
        assert " ".join(reason.split()) in line, (reason, line)


@pytest.mark.slow
def test_train_moe_plot(finished):
    tmp, results = finished
    out = tmp / "out"
    assert results["train_moe"][0] == 0, results["train_moe"][1]
    import matplotlib.image

    png = out / "train_moe.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 1000
    assert pixels[..., :3].std() > 0.1                                    # not a blank canvas


@pytest.mark.slow
def test_demo_runs(finished):
    code, log = finished[1]["demo"]
    assert code == 0, log          # the demo exits non-zero if its loss does not fall
    assert "dispatch+combine" in log and "tokens/s" in log, log
    # which backend each op of the step resolved to
    ops = ("layout", "dispatch", "combine", "broadcast_in_place", "slot_values")
    pattern = "backend auto resolved per op: " + ", ".join(f"{op} -> (reference|cuda)" for op in ops) + "$"
    assert re.search(pattern, log, re.M), log


def test_demo_resolved_backends():
    import demo

    from jax_ep import runtime
    from jax_ep.config import EPConfig

    def cfg(backend):
        return EPConfig(num_experts=16, num_topk=2, hidden=64, max_tokens_per_rank=128, backend=backend)

    assert demo.resolved_backends(cfg("reference"), 8) == dict.fromkeys(demo.STEP_OPS, "reference")
    assert set(demo.resolved_backends(cfg("auto"), 8).values()) <= {"reference", "cuda"}
    usable, reason = runtime.available()
    if not usable:   # backend="cuda" here: each op says why, in full
        for op, impl in demo.resolved_backends(cfg("cuda"), 8).items():
            assert impl.startswith("unavailable: ") and reason in impl, (op, impl)


def test_demo_times_every_layers_exchange():
    """communication_time's program runs one exchange per MoE layer, as the model's step does (found by a
    review, 2026-12-05: its layers were identical independent calls, which XLA merged into one layer's:
    the printed dispatch+combine time was one layer's whatever the depth)."""
    import dataclasses

    import demo
    import jax
    import models
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))

    def all_to_alls(layers):
        cfg = dataclasses.replace(models.LMConfig(), num_layers=layers)
        fn, *args = demo.communication_program(mesh, cfg, 16, "reference")
        return fn.lower(*args).compile().as_text().count(" all-to-all(")

    one, two = all_to_alls(1), all_to_alls(2)
    assert one > 0 and two == 2 * one, (one, two)


def _fake_metrics(steps=20, layers=1, experts=16):
    """metrics.json as train_moe writes it: two runs with the same losses, two backends."""
    rng = np.random.default_rng(0)

    def run():
        return dict(loss=list(5.8 - np.linspace(0, 3, steps)), imbalance=list(1.5 + rng.random(steps)),
                    imbalance_cumulative=list(1.2 + rng.random(steps)), mean_imbalance=1.7,
                    expert_load=rng.integers(10, 100, (steps, layers, experts)).tolist())

    comm = dict(reference=dict(step_time_s=0.25, dispatch_combine_s=0.01, share=0.04),
                cuda=dict(step_time_s=0.05, dispatch_combine_s=0.01, share=0.2))
    model = dict(num_experts=experts, num_topk=2, num_layers=layers)
    config = dict(devices="8 x cpu", mesh=[2, 4], model=model, steps=steps, tokens_per_step=512,
                  bias_rate=0.05)
    return dict(runs=dict(no_balancing=run(), bias_balancing=run()), communication=comm, config=config)


def test_train_moe_plot_readable(tmp_path):
    """Overlapping loss curves differ in line style and marker; the step-time panel's axis ends just past
    the longest bar and its labels stay inside the panel."""
    import train_moe

    fig = train_moe.plot(_fake_metrics(), tmp_path / "p.png")
    ax_loss, _, ax_comm = fig.axes[:3]
    lines = ax_loss.get_lines()
    assert len(lines) == 2 and np.array_equal(lines[0].get_ydata(), lines[1].get_ydata())
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    assert lines[0].get_marker() != lines[1].get_marker()
    assert all(line.get_marker() not in (None, "None", "") for line in lines)
    assert ax_comm.get_title().startswith("Step time")
    left, right = ax_comm.get_xlim()
    assert left == 0 and 250 <= right <= 1.1 * 250          # the longest step: 250 ms
    bottom, top = ax_comm.get_ylim()
    assert bottom <= -0.25 and top >= 1.25 and top - bottom <= 2.5   # two bars of height 0.5 at 0 and 1
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()   # the figure is closed: a canvas to measure on
    box = ax_comm.get_window_extent(renderer)
    for text in ax_comm.texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()


@pytest.mark.slow
def test_train_moe_two_processes(finished):
    """Launched as 2 processes, train_moe builds its mesh over both processes' devices, process 0 alone
    prints and writes, and the training, its blocks rematerialised (--remat), is the one of a single
    process without."""
    tmp, results = finished
    code, log = results["train_moe_2proc"]
    assert code == 0, log
    assert "[p0] train_moe: 8 x cpu devices in 2 processes, mesh data x ep = 2 x 4" in log, log
    # process 1 prints none of the example's lines (gloo's connection messages are no concern here)
    words = ("train_moe", "loss", "imbalance", "backend", "wrote")
    printed = [line for line in log.splitlines() if line.startswith("[p1]") and any(w in line for w in words)]
    assert not printed, log
    one = json.loads((tmp / "out" / "metrics.json").read_text())
    two = json.loads((tmp / "out_2proc" / "metrics.json").read_text())
    assert two["config"]["devices"] == "8 x cpu" and two["config"]["mesh"] == [2, 4]
    assert two["config"]["model"]["remat"] and not one["config"]["model"]["remat"]
    if one["config"]["devices"] != "8 x cpu":
        pytest.skip(f"the single-process run used {one['config']['devices']}: nothing to compare on CPU")
    one, two = one["runs"], two["runs"]
    for name in one:
        # the same routing; losses to float32 rounding (gloo sums the ranks' gradients in another order:
        # measured 5e-7 after 8 steps)
        assert two[name]["expert_load"] == one[name]["expert_load"], name
        np.testing.assert_allclose(two[name]["loss"], one[name]["loss"], rtol=1e-5, err_msg=name)


DECODE_ARGS = ["--batch", "8", "--prompt-len", "8", "--steps", "6", "--layers", "1", "--repeats", "3"]


@pytest.mark.slow
def test_decode_moe_runs():
    """examples/decode_moe.py (issue 14 item 4), small: prefill + greedy decode on the low-latency ops;
    prints the backends of the prefill and decode ops, the step latency (median, p90), the
    dispatch/combine share and what it measured, and the check against the full forward passes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "decode_moe.py"), *DECODE_ARGS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert re.search(r"^backend auto resolved per op: prefill \(throughput\) layout -> (reference|cuda), "
                     r"dispatch -> (reference|cuda), combine -> (reference|cuda); decode \(low latency\) "
                     r"ll_dispatch -> (reference|cuda), ll_combine -> (reference|cuda)$", log, re.M), log
    devices = int(re.search(r"^jax_ep decode: (\d+) x \w+ devices", log, re.M).group(1))
    latency = re.search(r"decode step latency over 6 steps \(8 tokens per step\): median ([\d.]+) ms, "
                        r"p90 ([\d.]+) ms", log)
    assert latency, log
    median, p90 = float(latency.group(1)), float(latency.group(2))
    assert 0 < median <= p90, log
    share = re.search(r"^dispatch/combine: ([\d.]+) ms = (\d+)% of the median decode step \(measured: a "
                      r"compiled program of only the step's 1 ll_dispatch \+ ll_combine pairs", log, re.M)
    assert share and float(share.group(1)) > 0 and int(share.group(2)) > 0, log
    check = re.search(r"^check: the full forward \(throughput ops, no cache\) picks (\d+) of the (\d+) "
                      r"generated tokens$", log, re.M)
    assert check and int(check.group(2)) == 8 * (6 + 1), log
    assert int(check.group(1)) >= 0.9 * int(check.group(2)), log
    assert f"8 sequences ({8 // devices} per device)" in log, log


def test_decode_moe_help_and_bad_arguments():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = str(ROOT / "examples" / "decode_moe.py")
    help_text = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120).stdout
    # every option's entry (from its line to the next option's) names its default
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split())
               for entry in re.split(r"\n  (?=-)", help_text.split("options:")[1])[1:]}
    assert set(entries) >= {"--batch", "--prompt-len", "--steps", "--train-steps", "--backend",
                            "--dispatch-dtype", "--experts", "--repeats", "--seed"}, help_text
    for flag, entry in entries.items():
        assert flag == "-h" or "(default: " in entry, entry
    for flag, default in (("--prompt-len", "32"), ("--steps", "32"), ("--train-steps", "0"),
                          ("--backend", "auto"), ("--dispatch-dtype", "bfloat16"), ("--repeats", "50")):
        assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    bad = subprocess.run([sys.executable, script, "--batch", "3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--batch 3 must be a positive multiple of the device count" in bad.stderr


@pytest.mark.parametrize("script, argv, message", [
    ("demo.py", ["--steps", "0"], "--steps must be at least 2, got 0"),
    ("demo.py", ["--seq", "0"], "--seq must be at least 1, got 0"),
    ("train_moe.py", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("train_moe.py", ["--batch", "-8"], "--batch must be at least 1, got -8"),
    # below: an EPValueError of an internal field, or Flax's error, exit 1 (the bias rate's after the
    # first run had trained) before 2026-12-06
    ("train_moe.py", ["--bias-rate", "-1"], "--bias-rate must be a finite number >= 0, got -1.0"),
    ("train_moe.py", ["--bias-rate", "nan"], "--bias-rate must be a finite number >= 0, got nan"),
    ("train_moe.py", ["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    ("demo.py", ["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    ("train_moe.py", ["--experts", "1", "--mesh", "1,1"],
     "--experts 1 must be at least the experts per token, 2"),
    ("decode_moe.py", ["--hidden", "66"], "--hidden 66 must be a multiple of the attention heads, 4"),
])
def test_examples_name_a_bad_size_and_list_their_defaults(script, argv, message):
    """A size below 1 is a usage error naming the option (before 2026-12-05: an IndexError, numpy's
    error or an EPConfig field's); --help gives every option's default."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    path = str(ROOT / "examples" / script)
    bad = subprocess.run([sys.executable, path, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-500:]
    help_text = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120).stdout
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split())
               for entry in re.split(r"\n  (?=-)", help_text.split("options:")[1])[1:]}
    shared = ("--steps", "--batch", "--backend") + (() if script == "decode_moe.py" else ("--seq", "--lr"))
    for flag in shared:
        assert "(default: " in entries[flag], entries[flag]


@pytest.mark.slow
def test_train_moe_restore_on_four_devices(finished):
    """train_moe --save DIR on 8 devices (mesh data x ep = 2 x 4), then --restore DIR in a process of 4
    devices (mesh 2 x 2: EP 4 -> 2, expert weights resharded): each run's restored model has the saved
    model's loss on the fixed check batch, to float32 rounding (each rank's expert GEMM accumulates over
    its own number of local experts, the loss is a mean over other shards: measured 1 ulp), and trains
    on. Restoring into a model of other sizes (--experts 8) exits naming the field and both values."""
    tmp, results = finished
    code, log = results["train_moe"]
    assert code == 0, log
    saved = json.loads((tmp / "ckpt" / "train_moe.json").read_text())
    metrics = json.loads((tmp / "out" / "metrics.json").read_text())
    if metrics["config"]["devices"] != "8 x cpu":
        pytest.skip(f"the saving run used {metrics['config']['devices']}: nothing to compare on CPU")
    assert saved["mesh"] == [2, 4] and set(saved["check_loss"]) == {"no_balancing", "bias_balancing"}
    for name, run in metrics["runs"].items():
        assert run["checkpoint"]["saved"]["check_loss"] == saved["check_loss"][name]
        assert (tmp / "ckpt" / name).is_dir(), name
        assert f"saved to {tmp / 'ckpt' / name}: loss on the check batch" in log, log

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = str(ROOT / "examples" / "train_moe.py")
    same = ["--batch", str(BATCH), "--seq", str(SEQ), "--layers", str(LAYERS), "--bias-rate", "0.05",
            "--mesh", "2,2", "--steps", "2", "--restore", str(tmp / "ckpt")]
    commands = {"restore": [sys.executable, script, *same, "--experts", str(EXPERTS),
                            "--out", str(tmp / "out_restored")],
                "mismatch": [sys.executable, script, *same, "--experts", "8", "--out", str(tmp / "out_bad")]}
    results = run_logged(commands, tmp, cwd=tmp, env=env, wait_s=400)
    (restore_code, restore_log), (bad_code, bad_log) = results["restore"], results["mismatch"]
    assert restore_code == 0, restore_log
    assert "train_moe: 4 x cpu devices, mesh data x ep = 2 x 2" in restore_log, restore_log
    restored = json.loads((tmp / "out_restored" / "metrics.json").read_text())
    for name, run in restored["runs"].items():
        info = run["checkpoint"]["restored"]
        assert info["saved_check_loss"] == saved["check_loss"][name]
        np.testing.assert_allclose(info["check_loss"], saved["check_loss"][name], rtol=1e-6, err_msg=name)
        assert f"restored from {tmp / 'ckpt' / name} (saved on mesh data x ep = 2 x 4)" in restore_log
        assert all(math.isfinite(v) for v in run["loss"]) and len(run["loss"]) == 2, run["loss"]
    assert bad_code != 0, bad_log
    assert "MoE layer 'blocks/0/moe': routing.num_experts is 16 in the checkpoint, 8 in the model" in bad_log
    assert "Traceback" not in bad_log, bad_log
