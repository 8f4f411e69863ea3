"""What the emulator run scripts (run.py, ll_run.py, put_run.py) share: JAX on 8 virtual CPU devices
(the reference runs one device per rank), the drivers' dtype codes, random routing, building a driver
(g++ against emu_cuda.h), running it on per-rank input files, bit-exact comparison of its output
files, and the fault records it prints (emu_driver.h: report_faults)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from jax_ep import reference  # noqa: E402

KIND = {"bfloat16": 0, "float32": 1, "float8_e4m3fn": 2}  # cuda/ep_layout.h RowKind
# cuda/fingerprint.h FingerprintField by name (FingerprintFieldName): the kFingerprintWords published
# words from 1, then call_sequence (not published: the call count)
FIELD_ID = {name: i + 1 for i, name in enumerate((
    "op", "num_ranks", "num_tokens", "hidden", "num_topk", "num_experts", "capacity", "expert_alignment",
    "dtype", "transport", "call_sequence"))}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def to_dtype(a, name):
    return a.astype(getattr(ml_dtypes, name) if name != "float32" else np.float32)


def routing(rng, kind, R, T, K, E):
    """[R, T, K] int32 expert ids of one kind: distinct experts per token, messy (-1, out of range,
    repeats), skewed (half the tokens to expert 0) or fuzz (every kind of slot, hot experts)."""
    shape = (R, T, K)
    if kind == "distinct":
        return np.argsort(rng.random((R, T, E)), axis=2)[:, :, :K].astype(np.int32)
    if kind == "messy":
        idx = rng.integers(0, E, shape)
        u = rng.random(shape)
        idx = np.where(u < 0.2, rng.choice([-1, -5, E, E + 7], size=shape), idx)
        rep = rng.random(shape) < 0.2
        src = rng.integers(0, K, shape)
        idx = np.where(rep, np.take_along_axis(idx, src, axis=2), idx)
        return idx.astype(np.int32)
    if kind == "skewed":  # half the tokens to expert 0
        idx = np.argsort(rng.random((R, T, E)), axis=2)[:, :, :K].astype(np.int32)
        half = rng.random((R, T)) < 0.5
        idx[:, :, 0] = np.where(half, 0, idx[:, :, 0])
        idx = np.where((idx == 0) & (np.arange(K) > 0), -1, idx)
        return idx.astype(np.int32)
    if kind == "fuzz":  # every kind of slot: valid (some hot experts), -1, out of range, repeats
        hot = rng.integers(0, E, size=max(1, E // 4))
        idx = np.where(rng.random(shape) < 0.4, rng.choice(hot, size=shape), rng.integers(0, E, shape))
        u = rng.random(shape)
        bad = rng.choice(np.array([-2, -5, E, E + 7, INT32_MAX, INT32_MIN], np.int64), size=shape)
        idx = np.where(u < 0.15, -1, np.where(u < 0.3, bad, idx))
        if K > 1:  # copy an earlier slot (maybe an unused or bad one) into a later one
            rep = rng.random(shape) < 0.2
            src = rng.integers(0, np.maximum(np.arange(K), 1), size=shape)
            copied = np.take_along_axis(idx, src, axis=2)
            idx = np.where(rep & (np.arange(K) > 0), copied, idx)
        return idx.astype(np.int32)
    raise ValueError(kind)


# ---- the driver ----------------------------------------------------------------------------------
def build(sources, path: str, opt: str = "-O1 -g", root: str = ROOT) -> str:
    """g++ builds a driver from `sources` (paths from the repository root: kernels, drivers) against
    the CUDA emulation (emu_cuda.h, include/) at `path`; opt: optimisation / debug flags
    (fault_run.py takes -O0: a third of the compile time, for its few small cases); root: the tree
    whose sources, headers and emulation are built (ab_run.py: a copy with files from a revision)."""
    here = os.path.join(root, os.path.relpath(HERE, ROOT))
    cmd = ["g++", "-std=c++20", *opt.split(), "-ffp-contract=off", "-pthread", "-DJAX_EP_EMULATION",
           "-include", os.path.join(here, "emu_cuda.h"), "-I" + os.path.join(here, "include"),
           "-I" + root]
    for s in sources:
        cmd += ["-x", "c++", os.path.join(root, s)]
    subprocess.run(cmd + ["-o", path], check=True)
    return path


def write_inputs(d: str, inputs: dict) -> None:
    """inputs {name: [R, ...] array}: rank r's part of each into <d>/<name><r>.bin."""
    for name, a in inputs.items():
        for r in range(len(a)):
            np.ascontiguousarray(a[r]).tofile(os.path.join(d, f"{name}{r}.bin"))


def run_driver_case(name: str, cmd, inputs: dict, check, env=None, timeout: float = 600) -> bool:
    """`cmd[0] <tmp> *cmd[1:]` on the per-rank inputs (write_inputs) in a temporary directory, then
    check(tmp, seconds) on its outputs there. A failed driver prints its output and fails the case."""
    with tempfile.TemporaryDirectory() as d:
        write_inputs(d, inputs)
        start = time.time()
        proc = subprocess.run([str(c) for c in [cmd[0], d, *cmd[1:]]], capture_output=True, text=True,
                              timeout=timeout, env=env)
        took = time.time() - start
        if proc.returncode != 0:
            print(f"FAIL {name}: driver rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            return False
        return check(d, took)


# ---- comparing ------------------------------------------------------------------------------------
def load_output(d: str, field: str, r: int, rep: int, like: np.ndarray) -> np.ndarray:
    """Output `field` of rank r, repetition rep (<d>/<field><r>_<rep>.bin), as `like`'s dtype and shape."""
    return np.fromfile(os.path.join(d, f"{field}{r}_{rep}.bin"), dtype=like.dtype).reshape(like.shape)


def bits_equal(what: str, got: np.ndarray, ref: np.ndarray) -> bool:
    """got == ref bit for bit (NaN-safe; rows of the leading axis); prints the first difference."""
    width = int(np.prod(ref.shape[1:]))  # explicit: no rows at all is fine (T = 0, no routes)
    g2, r2 = got.reshape(len(got), width), ref.reshape(len(ref), width)
    size = ref.dtype.itemsize
    diff = g2.view(np.uint8).reshape(*g2.shape, size) != r2.view(np.uint8).reshape(*r2.shape, size)
    bad = np.argwhere(diff.any(-1))
    if len(bad):
        first = tuple(int(i) for i in bad[0])
        print(f"  MISMATCH {what}: {len(bad)} elements, first {first}: got {g2[first]!r} want {r2[first]!r}")
    return not len(bad)


def compare_rank(name: str, d: str, r: int, rep: int, want: dict) -> bool:
    """Every output of rank r, repetition rep, bit-exact against want ({field: [R, ...]})."""
    ok = True
    for field, ref in want.items():
        ref = np.atleast_1d(ref[r])
        ok &= bits_equal(f"{name} rank {r} rep {rep} {field}", load_output(d, field, r, rep, ref), ref)
    return ok


def rank_major_reference(x, idx, w, g, yr, cfg, rank_mask=None, keep=None, unmasked_dispatch=False) -> dict:
    """Inside shard_map, one rank: the reference's rank-major outputs as the drivers name their files
    (dispatch_rank_major, then combine_rank_major of yr and broadcast_rank_major of g through its
    handle, under rank_mask; unmasked_dispatch: the dispatch without it), and rm_y: yr as the expert
    kernel leaves it, NaN in the empty rows (combine_rank_major never reads them; keep: rows kept
    even if empty)."""
    m = reference.dispatch_rank_major(x, idx, w, cfg, None if unmasked_dispatch else rank_mask)
    filled = m.handle.src_index >= 0
    if keep is not None:
        filled = filled | keep
    yr_in = jax.numpy.where(filled[:, None], yr, jax.numpy.nan).astype(yr.dtype)
    out = dict(rm_rows=m.x, rm_ids=m.topk_idx, rm_w=m.topk_weights,
               rm_per_rank=m.num_tokens_per_rank, rm_per_expert=m.num_tokens_per_expert,
               rm_src=m.handle.src_index, rm_in_rank=m.handle.is_token_in_rank,
               rm_comb=reference.combine_rank_major(yr_in, m.handle, cfg, rank_mask),
               rm_bcast=reference.broadcast_rank_major(g, m.handle, cfg, rank_mask), rm_y=yr_in)
    if m.scales is not None:
        out["rm_scales"] = m.scales
    return out


# ---- faults ---------------------------------------------------------------------------------------
class Fault(NamedTuple):
    """A fault record as the driver prints it (cuda/device_state.h FaultRecord; what: waited_ordinal)."""

    kind: int
    op: int
    waited: int
    what: int
    field: int
    expected: int
    observed: int


FAULT_LINE = (r"^fault on rank (\d+): kind (-?\d+) op (-?\d+) waited (-?\d+) what (-?\d+) field (-?\d+) "
              r"expected (\d+) observed (\d+)$")


def faults_of(stdout: str) -> tuple[dict[int, Fault], dict[int, str]]:
    """The fault records and host messages a driver printed, by rank."""
    records = {int(m[0]): Fault(*(int(v) for v in m[1:])) for m in re.findall(FAULT_LINE, stdout, flags=re.M)}
    messages = {int(r): text for r, text in re.findall(r"^message of rank (\d+): (.*)$", stdout, flags=re.M)}
    return records, messages
