"""Times the CUDA dispatch and combine at one shape for several sender/receiver warp splits and copy
modes (``jax_ep.KernelConfig``: dispatch_send_warps, combine_send_warps, bulk_copy) and prints a table.

    python tools/ep_tune.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256] [--num-sms 24]
    python tools/ep_tune.py --rank-major ...   # dispatch_rank_major / combine_rank_major instead
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks import ops as bench  # noqa: E402
from jax_ep.config import KernelConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--splits", default="4:8:0,2:6:1,4:8:1,6:10:1,8:12:1",
                        help="dispatch send warps:combine send warps:bulk copy (0/1), comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--num-sms", type=int, default=None, help="KernelConfig.num_sms (default: all SMs)")
    parser.add_argument("--rank-major", action="store_true",
                        help="time dispatch_rank_major / combine_rank_major / broadcast_rank_major")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    rng = np.random.default_rng(0)
    rows = []
    for split in args.splits.split(","):
        send, reduce, bulk = split.split(":")
        kernel = KernelConfig(num_sms=args.num_sms, dispatch_send_warps=int(send),
                              combine_send_warps=int(reduce), bulk_copy=bool(int(bulk)))
        for dtype in args.dtypes.split(","):
            records = bench.bench_shape(mesh, "cuda", dtype, args.tokens, args.hidden, args.topk,
                                        args.experts, args.iters, args.repeats, rng, kernel=kernel,
                                        rank_major=args.rank_major)
            for r in records:
                rows.append((split, r["op"], r["dtype"], r["us"], r["wire_gbps"]))
                print(f"sms {args.num_sms or 'all':>3} split {split:8} {r['op']:20} {r['dtype']:15} "
                      f"{r['us']:9.1f} us {r['wire_gbps'] or 0:7.1f} wire GB/s", flush=True)  # None at EP1
    print("done", len(rows))


if __name__ == "__main__":
    main()
