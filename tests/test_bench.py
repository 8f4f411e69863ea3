"""The benchmark CLI runs on CPU virtual devices and writes the documented record format."""

import json

from jax_ep import bench

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
