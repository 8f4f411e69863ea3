"""The benchmark CLI (python -m benchmarks) runs on CPU virtual devices and writes the documented record
format."""

import json
import pathlib
import subprocess
import sys

from benchmarks import ops as bench

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIELDS = {"op", "backend", "dtype", "tokens_per_rank", "hidden", "topk", "num_experts", "ep_size",
          "us", "logical_gbps", "wire_gbps", "pct_of_peak", "num_sms", "device", "date"}


def test_bench_writes_records(tmp_path):
    out = tmp_path / "bench.json"
    records = bench.main(["--preset", "small", "--tokens", "32", "--dtypes", "bfloat16,float8_e4m3fn",
                          "--backends", "reference", "--iters", "2", "--repeats", "1",
                          "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(records))
    assert sorted((r["op"], r["dtype"]) for r in saved) == [
        ("combine", "bfloat16"), ("combine", "bfloat16"), ("dispatch", "bfloat16"),
        ("dispatch", "float8_e4m3fn")]
    for r in saved:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["us"] > 0 and r["logical_gbps"] > 0 and r["wire_gbps"] > 0
        assert r["logical_gbps"] >= r["wire_gbps"]  # wire counts only the rows that leave the rank
        assert r["ep_size"] == 8 and r["tokens_per_rank"] == 32


LAYER_FIELDS = {"op", "step_ms", "roofline_ms", "gemm_ms", "gemm_tflops", "split_ms", "backend", "gemm",
                "hidden", "ffn_hidden", "num_experts", "topk", "tokens_per_rank", "ep_size", "device", "date"}


def test_layer_bench_writes_records(tmp_path):
    out = tmp_path / "layer.json"
    records = bench.main(["--layer", "--layer-shapes", "small", "--iters", "1", "--repeats", "1",
                          "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    assert [r["config"] for r in records] == ["jax_ep", "plain_jax"]
    for r in records:
        assert LAYER_FIELDS <= set(r), LAYER_FIELDS - set(r)
        assert r["op"] == "moe_layer" and r["gemm"] == "ragged_dot"   # no Hopper GPU here
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["ep_size"] == 8
    assert records[1]["backend"] == "reference"


def test_cli_help():
    """`python -m benchmarks --help` from the repository root lists the op and the layer options."""
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--preset", "--tokens", "--backends", "--num-sms", "--profile", "--layer", "--layer-shapes",
                 "--out"):
        assert flag in out.stdout, flag
