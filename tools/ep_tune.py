"""Times the CUDA dispatch and combine at one shape for several sender/receiver warp splits (the
JAX_EP_{DISPATCH,COMBINE}_SEND_WARPS knobs, read at trace time) and prints a table.

    python tools/ep_tune.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jax_ep import bench  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--splits", default="4:8:0,2:6:1,4:8:1,6:10:1,8:12:1",
                        help="dispatch:combine send warps:tma, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--num-sms", type=int, default=None, help="EPConfig.num_sms (default 24)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.num_sms is not None:  # bench_shape builds its own EPConfig: give it this num_sms
        bench.EPConfig = functools.partial(EPConfig, num_sms=args.num_sms)
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    rng = np.random.default_rng(0)
    rows = []
    for split in args.splits.split(","):
        send, reduce, tma = split.split(":")
        os.environ["JAX_EP_DISPATCH_SEND_WARPS"] = send
        os.environ["JAX_EP_COMBINE_SEND_WARPS"] = reduce
        os.environ["JAX_EP_TMA"] = tma
        for dtype in args.dtypes.split(","):
            records = bench.bench_shape(mesh, "cuda", dtype, args.tokens, args.hidden, args.topk,
                                        args.experts, args.iters, args.repeats, rng)
            for r in records:
                rows.append((split, r["op"], r["dtype"], r["us"], r["wire_gbps"]))
                print(f"sms {args.num_sms or 24:3} split {split:8} {r['op']:9} {r['dtype']:15} "
                      f"{r['us']:9.1f} us {r['wire_gbps']:7.1f} wire GB/s", flush=True)
    print("done", len(rows))


if __name__ == "__main__":
    main()
