"""Runs the low-latency CUDA kernels (cuda/low_latency.cu) on the CPU emulation (emu_cuda.h +
ll_driver.cc, the blocks of a launch concurrently) and compares them with
jax_ep.reference.ll_dispatch / ll_combine: counts, src_slot, every filled slot's row (and FP8
scales), the `active` ranks and the handle's slots the kernel writes (topk_weights as bits,
dest_rank, num_dropped; a two-phase send's pass through its receive) bit-exact; combine
bit-exact too (float32 sums in top-k order, no FMA, in both), with NaN in every unfilled slot of
y (it must not leak). Each case runs the ops fused, in two phases, or with two
calls in flight (mode 0 / 1 / 2), some with more blocks than tokens (a token's slots sent as parts
from several blocks); three more cases break the double-buffering rules and must fault
(a third send in flight; a call token received twice; a receive of another shape), and the
config-fingerprint cases (MISMATCHES) give the last rank's call another field of
cuda/fingerprint.h (or a call count 5 calls ahead): every rank must fault naming the field and both
values, in the record and in the host's message (xla_ffi/fault_message.cc), at 2 ranks and (two
fields, MISMATCHES_AT_4) at 4, where every rank faults too. Rank masking (MASKED):
explicit masks per repetition (bf16 and FP8; fused, two-phase, two calls in flight with different
masks) and random masks on the random cases, against the reference with each mask; shrink mode
(modes 6-8: the last rank never calls, or stops after one ll_dispatch): the others' outputs equal the
reference with it masked, the timeout is paid once, the persistent mask names rank, op and
'discovery', the host's clear empties it (check_shrink).

    python tools/kernel_emulator/ll_run.py [--random N] [--seed S]
    python tools/kernel_emulator/ll_run.py --quick   # the first 4 fixed cases only (a smoke test)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from harness import FIELD_ID, KIND, build, faults_of, routing, write_inputs  # noqa: E402  (8 CPU devices)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep import reference  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402

DRIVER = os.path.join(tempfile.gettempdir(), "jax_ep_emu_ll_driver")
SOURCES = ("cuda/group.cu", "cuda/dispatch.cu", "cuda/low_latency.cu", "xla_ffi/fault_message.cc",
           "tools/kernel_emulator/ll_driver.cc")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float8_e4m3fn": ml_dtypes.float8_e4m3fn}

CASES = [  # R, T, H, K, E, x dtype, wire dtype, routing, mode (0 fused, 1 two-phase, 2 two in flight)
    (2, 7, 64, 3, 8, "bfloat16", "bfloat16", "messy", 0),
    (2, 16, 256, 4, 8, "bfloat16", "float8_e4m3fn", "distinct", 0),
    (3, 5, 128, 2, 6, "float32", "bfloat16", "messy", 1),
    (4, 9, 128, 4, 16, "float32", "float8_e4m3fn", "messy", 2),
    (1, 4, 24, 2, 4, "bfloat16", "bfloat16", "skewed", 0),
    (2, 1, 520, 1, 2, "bfloat16", "bfloat16", "distinct", 1),
    (2, 0, 128, 2, 4, "bfloat16", "float8_e4m3fn", "messy", 2),
    (2, 3, 4224, 2, 4, "bfloat16", "bfloat16", "messy", 1),      # rows of 2 pieces (8448 bytes)
    (2, 2, 8320, 2, 4, "float32", "float8_e4m3fn", "distinct", 0),  # fp8 rows of 2 pieces
    (2, 6, 128, 3, 64, "bfloat16", "float8_e4m3fn", "messy", 1),   # one block: 16 warps, 64 pairs
    # fewer tokens than blocks: each token's slots are sent as G parts from G blocks
    (3, 2, 256, 4, 12, "bfloat16", "float8_e4m3fn", "messy", 0),   # 8 blocks: G = 4
    (2, 3, 136, 3, 6, "float32", "bfloat16", "messy", 1),          # 7 blocks: G = 2 (slots 0, 2 | 1)
    (8, 5, 256, 8, 16, "bfloat16", "float8_e4m3fn", "messy", 1),   # EP8 (issue 16: no 8-GPU machine)
]
BLOCKS = {9: 1, 10: 8, 11: 7}  # fixed cases run with 3 blocks but these
# Rank masking: (case, the mask of each of the 2 repetitions). A masked rank sends and receives
# nothing; the mask changes between the calls (and between the two calls in flight in mode 2).
MASKED = [
    ((3, 6, 128, 3, 9, "bfloat16", "bfloat16", "messy", 0), [[1, 0, 1], [1, 1, 0]]),
    ((4, 9, 256, 4, 16, "float32", "float8_e4m3fn", "messy", 1), [[0, 1, 1, 1], [1, 1, 0, 1]]),
    ((4, 5, 128, 3, 8, "bfloat16", "float8_e4m3fn", "skewed", 2), [[1, 0, 1, 1], [1, 1, 1, 0]]),
    ((2, 4, 64, 2, 4, "bfloat16", "bfloat16", "distinct", 1), [[1, 0], [0, 1]]),
    ((3, 1, 128, 2, 6, "bfloat16", "bfloat16", "messy", 0), [[1, 0, 1], [0, 1, 1]]),  # 2 parts per token
    # shrink mode (EPConfig.shrink), the last rank never calls: explicit masks on top in the second
    ((3, 5, 128, 3, 9, "bfloat16", "float8_e4m3fn", "messy", 6), [[1, 1, 1], [0, 1, 1]]),
    ((4, 4, 64, 2, 8, "float32", "bfloat16", "messy", 7), [[1, 1, 1, 1], [1, 1, 1, 1]]),
    # the last rank takes part in the first ll_dispatch, then stops: the others' ll_combine waits for
    # rows it never returns, masks it and adds +0.0 for them
    ((3, 6, 128, 3, 6, "bfloat16", "bfloat16", "skewed", 8), [[1, 1, 1], [1, 1, 1]]),
]
# Broken rules: (mode, LLFault the kernels must report): a third two-phase send while two are in
# flight (kLLFaultTooMany), a call token received twice (kLLFaultStaleToken).
# A receive by a call site of another shape (kLLFaultShape).
FAULTS = [(3, 1), (4, 3), (5, 2)]
MODES = {0: "fused", 1: "two-phase", 2: "two in flight", 3: "third send", 4: "received twice",
         5: "received as another shape", 6: "shrink, last rank absent, fused",
         7: "shrink, last rank absent, two-phase",
         8: "shrink, last rank stops after one ll_dispatch, fused"}


# Config-fingerprint cases (ll_driver.cc `mismatch`): ranks 0..R-2 run a fused ll_dispatch of
# MISMATCH_SIZES (R = 2, or 4 for MISMATCHES_AT_4), the last rank the same call with one field
# changed: field -> (FingerprintField id, the other ranks' value, the last rank's), as the messages
# print them.
MISMATCH_SIZES = (2, 4, 128, 2, 12)  # R, T, H, K, E; bf16 x and wire
MISMATCHES = {
    "op": (FIELD_ID["op"], "ll_dispatch", "ll_combine"),
    "op_throughput": (FIELD_ID["op"], "ll_dispatch", "dispatch"),  # rank 1 runs the throughput dispatch
    "num_ranks": (FIELD_ID["num_ranks"], 2, 3),
    "num_tokens": (FIELD_ID["num_tokens"], 4, 5),
    "hidden": (FIELD_ID["hidden"], 128, 136),
    "num_topk": (FIELD_ID["num_topk"], 2, 1),
    "num_experts": (FIELD_ID["num_experts"], 12, 14),
    "dtype": (FIELD_ID["dtype"], "bfloat16", "float8_e4m3fn"),
    "call_sequence": (FIELD_ID["call_sequence"], None, None),  # rank 1 is 5 calls ahead
}
# The same at 4 ranks, the fields of tests/gpu/test_fingerprint_gpu.py's process-model-1 cases (one
# rank in the other branch of a lax.cond): every rank faults, not only the odd one and one peer.
MISMATCHES_AT_4 = ("op_throughput", "hidden")
NUMBERS = {"ll_dispatch": 7, "ll_combine": 8, "dispatch": 2, "bfloat16": 0, "float8_e4m3fn": 2}


def run_mismatch(driver, field, ranks: int = 2) -> str:
    """A config-fingerprint case at `ranks` ranks, the last one's call differing: '' when every rank
    reported what it must. Every rank compares every peer's fingerprint before it writes, and a rank
    that finds a difference publishes its own before it traps, so every rank faults (not only the
    last one and one peer): ranks 0..R-2 naming the last rank, the last rank naming any other (its
    device's one record goes to the first of its peer threads to claim it)."""
    _, T, H, K, E = MISMATCH_SIZES
    R = ranks
    last = R - 1
    done = subprocess.run([driver, tempfile.gettempdir(), str(R), str(T), str(H), str(K), str(E),
                           str(KIND["bfloat16"]), str(KIND["bfloat16"]), "1", "2", "0", field],
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    records, messages = faults_of(out)
    if done.returncode == 0 or sorted(records) != list(range(R)) or sorted(messages) != list(range(R)):
        return f"expected a fault on every rank, got rc={done.returncode}:\n{out[-3000:]}"
    field_id, *values = MISMATCHES[field]
    for rank, (kind, _op, waited, _what, got_field, expected, observed) in records.items():
        text = messages[rank]
        side = int(rank == last)  # values[1]: the last rank's
        if (rank == last) == (waited == last) or not 0 <= waited < R:
            return f"rank {rank}: record {records[rank]} names rank {waited}"
        if field == "call_sequence":
            want = (5, field_id, 1, 6) if rank != last else (1, field_id, 6, 1)
            phrase = "out of step" if rank != last else f"rank {waited} has entered 1 (it is 5 calls behind"
        else:
            mine, theirs = values[side], values[1 - side]
            want = (5, field_id, NUMBERS.get(mine, mine), NUMBERS.get(theirs, theirs))
            name = "op" if field == "op_throughput" else field
            phrase = f"{name} is {mine} on rank {rank} and {theirs} on rank {waited}"
        if (kind, got_field, expected, observed) != want:
            return f"rank {rank}: record {records[rank]}, want kind/field/expected/observed {want}"
        op = values[1] if field.startswith("op") and rank == last else "ll_dispatch"
        for part in (f"jax_ep: {op} on GPU {rank} (rank {rank})", phrase):
            if part not in text:
                return f"rank {rank}: message lacks {part!r}: {text}"
    return ""


def reference_outputs(R, T, K, E, H, wire, x, idx, w, y, mask=None, combine_mask=None):
    """jax_ep.reference.ll_dispatch / ll_combine of every rank (mask: int32 [R], 1 = active;
    combine_mask: ll_combine's, the dispatch's by default)."""
    cfg = EPConfig(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=max(T, 1),
                   dispatch_dtype=wire,
                   axis_name="ep", backend="reference")
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    mask = np.ones(R, np.int32) if mask is None else np.asarray(mask, np.int32)
    combine_mask = mask if combine_mask is None else np.asarray(combine_mask, np.int32)

    def body(x, idx, w, y, mask, combine_mask):
        d = reference.ll_dispatch(x[0], idx[0], w[0], cfg, rank_mask=mask)
        out = reference.ll_combine(y[0], d.handle, cfg, rank_mask=combine_mask)
        return jax.tree.map(lambda a: a[None], (d, out))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4 + (P(), P()), out_specs=P("ep")))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, w, y)]
    replicated = [jax.device_put(m, NamedSharding(mesh, P())) for m in (mask, combine_mask)]
    return jax.tree.map(np.asarray, fn(*args, *replicated))


def write_rep_inputs(tmp, rep, mask, d) -> None:
    """Repetition rep's mask and, per rank, the reference handle's weights and ranks."""
    np.asarray(mask, np.int32).tofile(os.path.join(tmp, f"mask_{rep}.bin"))
    for r in range(len(mask)):
        np.ascontiguousarray(d.handle.topk_weights[r]).tofile(os.path.join(tmp, f"w{r}_{rep}.bin"))
        np.ascontiguousarray(d.handle.dest_rank[r]).tofile(os.path.join(tmp, f"dest{r}_{rep}.bin"))


def run_fault(driver, mode, what) -> str:
    """A case that breaks a double-buffering rule: every rank must fault with LLFault `what`."""
    R, T, H, K, E = 2, 4, 128, 2, 4
    rng = np.random.default_rng(mode)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(R):
            for name, a in (("x", rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)),
                            ("idx", routing(rng, "messy", 1, T, K, E)[0]),
                            ("tw", rng.random((T, K)).astype(np.float32)),
                            ("w0_", rng.random((T, K)).astype(np.float32)),
                            ("dest0_", np.zeros((T, K), np.int32)),
                            ("y", np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))):
                np.ascontiguousarray(a).tofile(os.path.join(tmp, f"{name}{r}.bin"))
            os.replace(os.path.join(tmp, f"w0_{r}.bin"), os.path.join(tmp, f"w{r}_0.bin"))
            os.replace(os.path.join(tmp, f"dest0_{r}.bin"), os.path.join(tmp, f"dest{r}_0.bin"))
        np.ones(R, np.int32).tofile(os.path.join(tmp, "mask_0.bin"))
        done = subprocess.run([driver, tmp, str(R), str(T), str(H), str(K), str(E),
                               str(KIND["bfloat16"]), str(KIND["bfloat16"]), "1", "2", str(mode)],
                              capture_output=True, text=True, timeout=600)
    records, _ = faults_of(done.stdout)
    faulted = [records.get(r, (None,) * 4)[:4] == (4, 7, -1, what) for r in range(R)]  # kind op waited what
    if done.returncode == 0 or not all(faulted):
        return f"expected LLFault {what} on every rank, got rc={done.returncode}: {done.stdout[-2000:]}"
    return ""


def run_case(driver, R, T, H, K, E, x_dtype, wire, kind, mode, seed, reps=2, blocks=3,
             masks=None) -> str:
    """masks: the rank mask of each repetition (int32 [R], 1 = active); all active by default.
    Modes 6 / 7 (shrink mode, the last rank absent; ll_driver.cc): the others' outputs must equal
    the reference with that rank masked, the first repetition must have waited for the timeout and
    the later ones not, the persistent mask must name the rank, and after the host's clear a
    repetition with the rank in the explicit mask must neither wait nor set the mask again."""
    rng = np.random.default_rng(seed)
    local = E // R
    shrink = mode in (6, 7, 8)
    masks = [np.ones(R, np.int32)] * reps if masks is None else [np.asarray(m, np.int32) for m in masks]
    operand_masks = masks
    if shrink:  # the kernels see all-ones masks, then the one after the clear; the reference the rank masked
        absent_masked = np.ones(R, np.int32)
        absent_masked[R - 1] = 0
        operand_masks = masks + [absent_masked]
        masks = [m & absent_masked for m in operand_masks]
    x = (rng.standard_normal((R, T, H)) * 3).astype(np.float32).astype(DTYPES[x_dtype])
    idx = routing(rng, kind, R, T, K, E)
    w = rng.random((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, local, R * T, H)).astype(np.float32).astype(ml_dtypes.bfloat16)
    filled = np.zeros((R, local, R * T), bool)
    for m in {tuple(m) for m in masks}:
        filled |= reference_outputs(R, T, K, E, H, wire, x, idx, w, y, m)[0].handle.src_slot >= 0
    # NaN in every slot no repetition fills (unfilled and masked slots must not leak into combine)
    y = np.where(filled[..., None], y, np.nan).astype(ml_dtypes.bfloat16)
    wants = [reference_outputs(R, T, K, E, H, wire, x, idx, w, y, m) for m in masks]
    if mode == 8:  # the first dispatch had every rank; its combine lost the last one
        wants[0] = reference_outputs(R, T, K, E, H, wire, x, idx, w, y, operand_masks[0], masks[0])
    with tempfile.TemporaryDirectory() as tmp:
        write_inputs(tmp, dict(x=x, idx=idx, tw=w, y=y))
        for rep_i, (m, (d_rep, _)) in enumerate(zip(operand_masks, wants, strict=True)):
            write_rep_inputs(tmp, rep_i, m, d_rep)
        bound_s = shrink_bound() if shrink else None
        env = dict(os.environ, JAX_EP_EMU_TIMEOUT_S=str(bound_s)) if shrink else None
        done = subprocess.run([driver, tmp, str(R), str(T), str(H), str(K), str(E),
                               str(KIND[x_dtype]), str(KIND[wire]), str(reps), str(blocks),
                               str(mode)],
                              capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            return f"driver failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}"
        if shrink and (error := check_shrink(tmp, R, reps, mode, bound_s)):
            return error
        for r in range(R - 1 if shrink else R):
            for rep in range(len(masks)):
                tag = f"{r}_{rep}"
                d, want_out = wants[rep]
                def load(n, dt, shape, tag=tag):
                    return np.fromfile(os.path.join(tmp, f"{n}{tag}.bin"), dtype=dt).reshape(shape)

                counts = load("counts", np.int32, (local, R))
                src = load("src", np.int32, (local, R * T))
                rows = load("rows", DTYPES[wire], (local, R * T, H))
                out = load("out", ml_dtypes.bfloat16, (T, H))
                where = f"rank {r} rep {rep}"
                active = load("active", np.int32, (R,))
                if not np.array_equal(active, d.rank_mask[r]):
                    return f"{where}: active ranks {active.tolist()} != {d.rank_mask[r].tolist()}"
                # the handle's slots the kernel writes itself: bit-exact (weights as bits)
                handle_w = load("hw", np.float32, (T, K))
                if not np.array_equal(handle_w.view(np.uint32), d.handle.topk_weights[r].view(np.uint32)):
                    return f"{where}: handle topk_weights differ"
                if not np.array_equal(load("hdest", np.int32, (T, K)), d.handle.dest_rank[r]):
                    return f"{where}: handle dest_rank differs"
                dropped = int(load("hdropped", np.int32, ())[()])
                if dropped != int(d.num_dropped[r]):
                    return f"{where}: num_dropped {dropped} != {int(d.num_dropped[r])}"
                if not np.array_equal(counts, d.counts[r]):
                    return f"{where}: counts {counts.tolist()} != {d.counts[r].tolist()}"
                if not np.array_equal(src, d.handle.src_slot[r]):
                    return f"{where}: src_slot differs"
                filled = src >= 0
                if not np.array_equal(rows[filled].view(np.uint8), d.x[r][filled].view(np.uint8)):
                    return f"{where}: rows differ in {int((rows[filled] != d.x[r][filled]).sum())}"
                if wire == "float8_e4m3fn":
                    scales = load("scales", np.float32, (local, R * T, H // 128))
                    if not np.array_equal(scales[filled], d.scales[r][filled]):
                        return f"{where}: scales differ"
                got, want = out.astype(np.float32), want_out[r].astype(np.float32)
                if not np.isfinite(got).all():
                    return f"{where}: combine output not finite (unfilled slots leaked)"
                scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
                err = float((np.abs(got - want) / scale).max()) if T else 0.0
                if err > 0:  # same float32 sums in top-k order, no FMA: bit-exact
                    return f"{where}: combine error {err:.3g} of the row max"
    return ""


def shrink_bound(base: float = 4.0) -> float:
    """The spin-wait bound of the shrink modes (JAX_EP_EMU_TIMEOUT_S): `base` seconds, more on a loaded
    machine (fault_run.machine_bound's reasoning). The check tells a repetition that waited out the
    bound from one that did not by its time, so the bound must stay above what a starved emulated
    call takes without waiting (6-7 s seen at load averages near 1000 per core)."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return max(base, 0.05 * per_core)


def check_shrink(tmp, R, reps, mode, timeout_s) -> str:
    """Modes 6 / 7 / 8: what each present rank's persistent mask and timings show (mode 8: the
    first ll_combine, the group's second call, masked the rank)."""
    absent = R - 1
    event = np.dtype([("op", np.int32), ("during", np.int32), ("epoch", np.uint64)])
    state = np.dtype([("masked", np.uint32), ("rank", np.int32), ("events", event, (32,))])
    for r in range(absent):
        persistent = np.fromfile(os.path.join(tmp, f"masked{r}.bin"), dtype=state)[0]
        ev = persistent["events"][absent]
        if int(persistent["masked"]) != 1 << absent or int(persistent["rank"]) != r:
            return f"rank {r}: persistent mask {int(persistent['masked']):#x} rank {persistent['rank']}"
        want = (NUMBERS["ll_combine"], 1, 2) if mode == 8 else (NUMBERS["ll_dispatch"], 1, 1)
        if (int(ev["op"]), int(ev["during"]), int(ev["epoch"])) != want:
            return f"rank {r}: event {ev} (want op, during (1: discovery), epoch {want})"
        if any(int(e["op"]) for i, e in enumerate(persistent["events"]) if i != absent):
            return f"rank {r}: events for ranks other than {absent}"
        times = [float(np.fromfile(os.path.join(tmp, f"time{r}_{i}.bin"))[0]) for i in range(reps + 1)]
        # a call that waited for the absent rank again would take the whole timeout at least
        if times[0] < timeout_s or max(times[1:]) >= timeout_s:
            return f"rank {r}: repetition times {times}: the first must wait out the timeout, no other"
        cleared = int(np.fromfile(os.path.join(tmp, f"cleared{r}.bin"), dtype=np.uint32)[0])
        if cleared != 0:
            return f"rank {r}: mask {cleared:#x} after the clear and an explicitly masked call"
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", type=int, default=0, help="random cases besides the fixed ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--driver", default=DRIVER, help="where to build the driver")
    parser.add_argument("--quick", action="store_true",
                        help="only the first 4 fixed cases (fused, two-phase, two calls in flight; bf16 and "
                             "FP8 wire; 2-4 ranks): no masked, random, fault or mismatch cases")
    args = parser.parse_args(argv)
    driver = build(SOURCES, args.driver)
    if args.quick:
        failed = 0
        for i, case in enumerate(CASES[:4]):
            n = BLOCKS.get(i, 3)
            error = run_case(driver, *case, seed=[args.seed, i], blocks=n, masks=None)
            print(f"{'FAIL' if error else 'ok  '} {case} {MODES[case[-1]]}, {n} blocks {error}", flush=True)
            failed += bool(error)
        print(f"{4 - failed}/4 low-latency cases pass")
        return 1 if failed else 0
    cases = list(CASES)
    rng = np.random.default_rng(args.seed)
    blocks = [BLOCKS.get(i, 3) for i in range(len(cases))]
    masks = [None] * len(cases)
    for case, case_masks in MASKED:
        cases.append(case)
        blocks.append(2)
        masks.append(case_masks)
    mask_rng = np.random.default_rng([args.seed, 15])  # apart from rng: the unmasked draws stay as they were
    for _ in range(args.random):
        R = int(rng.integers(1, 5))
        E = R * int(rng.integers(1, 4))
        K = int(rng.integers(1, min(E, 6) + 1))
        wire = str(rng.choice(["bfloat16", "float8_e4m3fn"]))
        H = 128 * int(rng.integers(1, 3)) if wire != "bfloat16" else 8 * int(rng.integers(1, 40))
        cases.append((R, int(rng.integers(0, 12)), H, K, E, str(rng.choice(["bfloat16", "float32"])),
                      wire, "messy", int(rng.integers(0, 3))))
        blocks.append(int(rng.integers(1, 5)))
        masks.append([(mask_rng.random(R) < 0.7).astype(np.int32) for _ in range(2)])  # all 0 possible
    failed = 0
    for i, case in enumerate(cases):
        error = run_case(driver, *case, seed=[args.seed, i], blocks=blocks[i], masks=masks[i])
        shown = "" if masks[i] is None else f", masks {[list(map(int, m)) for m in masks[i]]}"
        print(f"{'FAIL' if error else 'ok  '} {case} {MODES[case[-1]]}, {blocks[i]} blocks{shown} {error}",
              flush=True)
        failed += bool(error)
    for mode, what in FAULTS:
        error = run_fault(driver, mode, what)
        print(f"{'FAIL' if error else 'ok  '} {MODES[mode]}: faults with LLFault {what} {error}",
              flush=True)
        failed += bool(error)
    for field, ranks in [(field, 2) for field in MISMATCHES] + [(f, 4) for f in MISMATCHES_AT_4]:
        error = run_mismatch(driver, field, ranks)
        at = "" if ranks == 2 else f" at {ranks} ranks"
        print(f"{'FAIL' if error else 'ok  '} mismatch {field}{at}: faults naming it {error}", flush=True)
        failed += bool(error)
    total = len(cases) + len(FAULTS) + len(MISMATCHES) + len(MISMATCHES_AT_4)
    print(f"{total - failed}/{total} low-latency cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
