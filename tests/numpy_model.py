"""An independent pure-NumPy model of jax_ep's dispatch / combine / layout semantics.

Written from the documented semantics (jax_ep.reference module docstring, jax_ep.types, jax_ep.config),
not from the reference implementation. It works on global arrays for all R ranks:

  x [R, T, H], topk_idx [R, T, K], topk_weights [R, T, K]

and returns, per receiving rank, what dispatch must produce there. Plain Python loops: the shapes in
the tests are small and clarity matters more than speed.

Semantics modelled:
  * sanitising: an id outside [0, E) is unused; a slot repeating an expert named by an earlier slot of
    the same token is unused.
  * expert e lives on rank e // E_local; receive rows are expert-major, within an expert ordered by
    (source rank, source token); segment e starts at sum_{e' < e} round_up(count_e', alignment).
  * capacity C: a row whose position reaches C is dropped; group_sizes = round_up(kept, alignment).
  * a received token is named by slot n = src_rank * T + src_token; token_rows[n, k] is its receive
    row, -1 where the slot is not routed to this rank, -2 where it is but was dropped.
  * combine: per token, sum over its kept (token, expert) rows of weight * y_row; its backward's
    d row_weights in the documented float32 order (dot_exact).
  * rank masking (rank_mask [R] bool): a masked rank sends and receives nothing. Only pairs from an
    active source to an expert of an active rank enter the segments above; every other valid pair
    goes nowhere and counts in its source rank's num_dropped (nowhere: [(token, k, expert)]). A
    masked rank's token_rows are all -1.
  * FP8: per token, per 128 channels: scale = max(amax, 1e-4) / 448, q = e4m3(x * (448 / amax_c)).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

FP8_BLOCK = 128
FP8_MAX = np.float32(448.0)
FP8_MIN_AMAX = np.float32(1e-4)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sanitize(topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., K] ids -> same shape; out-of-range and repeated (later) slots become -1."""
    idx = np.asarray(topk_idx).astype(np.int64)
    out = np.full(idx.shape, -1, np.int64)
    flat_in = idx.reshape(-1, idx.shape[-1])
    flat_out = out.reshape(-1, idx.shape[-1])
    for i, row in enumerate(flat_in):
        seen = set()
        for k, e in enumerate(row):
            e = int(e)
            if 0 <= e < num_experts and e not in seen:
                seen.add(e)
                flat_out[i, k] = e
    return out


def worst_case_capacity(ep_size: int, max_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    """Every token of every rank picks min(K, E_local) experts of one rank; each segment may carry up
    to alignment - 1 padding rows."""
    local = num_experts // ep_size
    return round_up(ep_size * max_tokens * min(topk, local) + local * (alignment - 1), alignment)


def quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32)."""
    xf = np.asarray(x).astype(np.float32)
    t, h = xf.shape
    nb = -(-h // FP8_BLOCK)
    padded = np.zeros((t, nb * FP8_BLOCK), np.float32)
    padded[:, :h] = xf
    blocks = padded.reshape(t, nb, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=2), FP8_MIN_AMAX).astype(np.float32)
    inv = (FP8_MAX / amax).astype(np.float32)
    scaled = (blocks * inv[:, :, None]).astype(np.float32).reshape(t, nb * FP8_BLOCK)[:, :h]
    q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return q, (amax / FP8_MAX).astype(np.float32)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    c, h = q.shape
    return q.astype(np.float32) * np.repeat(scales, FP8_BLOCK, axis=1)[:, :h]


@dataclasses.dataclass
class RankLayout:
    num_tokens_per_rank: np.ndarray   # [R] int32
    num_tokens_per_expert: np.ndarray  # [E] int32
    is_token_in_rank: np.ndarray      # [T, R] bool


@dataclasses.dataclass
class RankDispatch:
    rows: np.ndarray          # [C, H] payload dtype; zeros where no row
    scales: np.ndarray | None  # [C, nb] float32 (FP8 only)
    src: np.ndarray           # [C] int32 slot n = src_rank * T + src_token; -1 = empty
    group_sizes: np.ndarray   # [E_local] int32 (aligned)
    expert_counts: np.ndarray  # [E_local] int32 rows kept per local expert (unpadded)
    received: np.ndarray      # [E_local] int32 rows routed to each local expert (before capacity)
    row_weights: np.ndarray   # [C] float32
    num_dropped: int
    token_rows: np.ndarray    # [R*T, K] int32 receive row of (slot n, top-k slot k); -1 = not routed
    #                           here, -2 = routed here but dropped for lack of capacity
    dropped: list             # [(src_rank, src_token, k, expert)] rows dropped on this rank, in order
    nowhere: list             # [(token, k, expert)] this rank's own pairs a rank mask sends nowhere
    #                           (num_dropped = len(dropped) + len(nowhere))


@dataclasses.dataclass
class ModelResult:
    ranks: list               # [R] RankDispatch
    layouts: list             # [R] RankLayout (source side)
    sanitized: np.ndarray     # [R, T, K]
    kept: np.ndarray          # [R, T, K] bool: this (token, slot) has a receive row somewhere
    capacity: int
    active: np.ndarray        # [R] bool: the ranks the call ran with (dispatch's rank_mask output)


def layout(topk_idx_rank: np.ndarray, num_experts: int, ep_size: int) -> RankLayout:
    """Layout of one source rank: topk_idx_rank [T, K]."""
    idx = sanitize(topk_idx_rank, num_experts)
    t = idx.shape[0]
    local = num_experts // ep_size
    in_rank = np.zeros((t, ep_size), bool)
    per_expert = np.zeros(num_experts, np.int32)
    for i in range(t):
        for e in idx[i]:
            if e >= 0:
                in_rank[i, e // local] = True
                per_expert[e] += 1
    return RankLayout(in_rank.sum(axis=0).astype(np.int32), per_expert, in_rank)


def payload_of(x_rank: np.ndarray, dispatch_dtype: str | None):
    """What travels for each token of one rank: (rows, scales or None)."""
    if dispatch_dtype is None:
        return np.asarray(x_rank), None
    if dispatch_dtype == "bfloat16":
        return np.asarray(x_rank).astype(ml_dtypes.bfloat16), None
    if dispatch_dtype == "float8_e4m3fn":
        return quantize_fp8(x_rank)
    raise ValueError(dispatch_dtype)


def dispatch(x, topk_idx, topk_weights, *, num_experts: int, capacity: int | None = None,
             alignment: int = 1, dispatch_dtype: str | None = None,
             max_tokens: int | None = None, rank_mask=None) -> ModelResult:
    x = np.asarray(x)
    topk_idx = np.asarray(topk_idx)
    topk_weights = np.asarray(topk_weights, np.float32)
    ep_size, tokens, topk = topk_idx.shape
    hidden = x.shape[2]
    local = num_experts // ep_size
    assert local * ep_size == num_experts
    if capacity is None:
        capacity = worst_case_capacity(ep_size, max_tokens or tokens, topk, num_experts, alignment)
    idx = sanitize(topk_idx, num_experts)
    active = np.ones(ep_size, bool) if rank_mask is None else np.asarray(rank_mask) != 0
    nowhere = [[(t, k, int(idx[s, t, k])) for t in range(tokens) for k in range(topk)
                if idx[s, t, k] >= 0 and not (active[s] and active[idx[s, t, k] // local])]
               for s in range(ep_size)]
    payloads = [payload_of(x[s], dispatch_dtype) for s in range(ep_size)]
    row_dtype = payloads[0][0].dtype
    kept_any = np.zeros(idx.shape, bool)

    ranks = []
    for d in range(ep_size):
        rows = np.zeros((capacity, hidden), row_dtype)
        scales = None if payloads[0][1] is None else np.zeros((capacity, payloads[0][1].shape[1]), np.float32)
        src = np.full(capacity, -1, np.int32)
        row_weights = np.zeros(capacity, np.float32)
        token_rows = np.full((ep_size * tokens, topk), -1, np.int32)
        group_sizes = np.zeros(local, np.int32)
        expert_counts = np.zeros(local, np.int32)
        received = np.zeros(local, np.int32)
        dropped = []
        offset = 0
        for le in range(local):
            expert = d * local + le
            entries = [(s, t, k) for s in range(ep_size) for t in range(tokens) for k in range(topk)
                       if idx[s, t, k] == expert and active[s] and active[d]]
            kept = 0
            for i, (s, t, k) in enumerate(entries):
                pos = offset + i
                if pos >= capacity:
                    dropped.append((s, t, k, expert))
                    token_rows[s * tokens + t, k] = -2
                    continue
                kept += 1
                rows[pos] = payloads[s][0][t]
                if scales is not None:
                    scales[pos] = payloads[s][1][t]
                src[pos] = s * tokens + t
                row_weights[pos] = topk_weights[s, t, k]
                token_rows[s * tokens + t, k] = pos
                kept_any[s, t, k] = True
            received[le] = len(entries)
            expert_counts[le] = kept
            group_sizes[le] = round_up(kept, alignment)
            offset += round_up(len(entries), alignment)
        ranks.append(RankDispatch(rows, scales, src, group_sizes, expert_counts, received, row_weights,
                                  len(dropped) + len(nowhere[d]), token_rows, dropped, nowhere[d]))
    layouts = [layout(topk_idx[s], num_experts, ep_size) for s in range(ep_size)]
    return ModelResult(ranks, layouts, idx, kept_any, capacity, active)


def combine(y, model: ModelResult, row_weights=None) -> np.ndarray:
    """y [R, C, H] (rank d's expert outputs) -> [R, T, H] float64: for each token, the sum over its kept
    rows of weight * y_row (row_weights [R, C] overrides the dispatch weights)."""
    y = np.asarray(y).astype(np.float64)
    ep_size = len(model.ranks)
    tokens = model.sanitized.shape[1]
    out = np.zeros((ep_size, tokens, y.shape[2]), np.float64)
    for d, rd in enumerate(model.ranks):
        weights = rd.row_weights if row_weights is None else np.asarray(row_weights[d])
        for j, n in enumerate(rd.src):
            if n >= 0:
                out[n // tokens, n % tokens] += np.float64(weights[j]) * y[d, j]
    return out


def combine_exact(y, model: ModelResult) -> np.ndarray:
    """The documented summation order, emulated in float32: each receiver sums in float32 and in top-k
    slot order the weighted rows of each (token, rank) pair and rounds to y's dtype; the source sums
    those partial sums in float32 in rank order and rounds to y's dtype."""
    y = np.asarray(y)
    dtype = y.dtype
    ep_size = len(model.ranks)
    tokens = model.sanitized.shape[1]
    topk = model.sanitized.shape[2]
    yf = y.astype(np.float32)
    out = np.zeros((ep_size, tokens, y.shape[2]), dtype)
    for s in range(ep_size):
        for t in range(tokens):
            n = s * tokens + t
            total = None
            for d, rd in enumerate(model.ranks):
                partial = np.zeros(y.shape[2], np.float32)
                for k in range(topk):
                    j = rd.token_rows[n, k]
                    if j >= 0:
                        partial = (partial + (yf[d, j] * rd.row_weights[j]).astype(np.float32)).astype(
                            np.float32)
                partial = partial.astype(dtype).astype(np.float32)
                total = partial if total is None else (total + partial).astype(np.float32)
            out[s, t] = total.astype(dtype)
    return out


def dot_exact(a, b) -> np.float32:
    """The documented float32 dot product of two rows (combine's d row_weights), emulated in float32:
    each product rounded; the rows zero-padded to a multiple of 256 and cut into steps of 256 (element
    256 s + 8 l + i: lane l < 32, i < 8); per (l, i) the steps summed in order, then each lane's 8 sums
    pairwise (i + 4, i + 2, i + 1), then the 32 lanes' pairwise (l + 16, ..., l + 1)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    width = -(-len(a) // 256) * 256
    if width == 0:
        return np.float32(0.0)
    products = np.zeros(width, np.float32)
    products[:len(a)] = a * b
    products = products.reshape(-1, 32, 8)
    acc = products[0]
    for step in products[1:]:
        acc = acc + step
    for half in (4, 2, 1):
        acc = acc[:, :half] + acc[:, half:2 * half]
    acc = acc[:, 0]
    for half in (16, 8, 4, 2, 1):
        acc = acc[:half] + acc[half:2 * half]
    return acc[0]


def dense_moe(x, topk_idx, topk_weights, expert_w, num_experts: int, kept=None) -> np.ndarray:
    """Naive per-token MoE in float64: out[t] = sum_k w_k * x[t] @ W[e_k] over sanitised slots (and,
    if given, only slots with kept[..., k])."""
    idx = sanitize(topk_idx, num_experts)
    x = np.asarray(x, np.float64)
    w = np.asarray(topk_weights, np.float64)
    expert_w = np.asarray(expert_w, np.float64)
    out = np.zeros(x.shape[:-1] + (expert_w.shape[-1],), np.float64)
    for pos in np.ndindex(*idx.shape[:-1]):
        for k, e in enumerate(idx[pos]):
            if e >= 0 and (kept is None or kept[pos + (k,)]):
                out[pos] += w[pos + (k,)] * (x[pos] @ expert_w[e])
    return out


# ---- low-latency (decode) mode ---------------------------------------------------------------------
# Fixed receive slots: on rank d, local expert e has R blocks of T slots; slot (e, s*T + i) holds the
# i-th token (in token order) of source rank s among those whose sanitised ids name expert d*E_local + e.
# combine: out[s, t] = bf16(sum over k in order, in float32, of float32(w * float32(y_back)) for the
# slots whose (sanitised) weight is nonzero), starting from +0.0.
@dataclasses.dataclass
class LLRank:
    x: np.ndarray              # [E_local, R*T, H] wire dtype; zeros in unfilled slots
    scales: np.ndarray | None  # [E_local, R*T, nb] float32 (FP8 only)
    counts: np.ndarray         # [E_local, R] int32
    src_slot: np.ndarray       # [E_local, R*T] int32: t*K + k of the source pair, -1 unfilled
    filled: np.ndarray         # [E_local, R*T] bool


@dataclasses.dataclass
class LLModel:
    ranks: list                # [R] LLRank (receiver side)
    weights: np.ndarray        # [R, T, K] float32: the handle's weights (0 where unused or dropped)
    sanitized: np.ndarray      # [R, T, K]
    placed: dict               # (s, t, k) -> (d, e, slot) for every pair sent
    dest_rank: np.ndarray      # [R, T, K] int32: the rank each sent pair went to, -1 elsewhere
    num_dropped: np.ndarray    # [R] int32: valid pairs not sent (their rank, or their source, masked)
    active: np.ndarray         # [R] bool: the rank mask of the call


def ll_dispatch(x, topk_idx, topk_weights, *, num_experts: int, dispatch_dtype: str | None,
                rank_mask=None) -> LLModel:
    """rank_mask: None or [R] (nonzero = active). A masked rank sends and receives nothing: a pair
    whose source or expert's rank is masked is dropped (weight 0, dest_rank -1, counted)."""
    x = np.asarray(x)
    topk_idx = np.asarray(topk_idx)
    ep_size, tokens, topk = topk_idx.shape
    hidden = x.shape[2]
    local = num_experts // ep_size
    active = np.ones(ep_size, bool) if rank_mask is None else np.asarray(rank_mask) != 0
    idx = sanitize(topk_idx, num_experts)
    sent = np.zeros(idx.shape, bool)
    for s in range(ep_size):
        for t in range(tokens):
            for k in range(topk):
                sent[s, t, k] = idx[s, t, k] >= 0 and active[s] and active[idx[s, t, k] // local]
    dest_rank = np.where(sent, idx // local, -1).astype(np.int32)
    num_dropped = ((idx >= 0) & ~sent).sum(axis=(1, 2)).astype(np.int32)
    weights = np.where(sent, np.asarray(topk_weights, np.float32), np.float32(0)).astype(np.float32)
    payloads = [payload_of(x[s], dispatch_dtype) for s in range(ep_size)]
    row_dtype = payloads[0][0].dtype if tokens else payload_of(np.zeros((1, hidden), x.dtype),
                                                                 dispatch_dtype)[0].dtype
    fp8 = dispatch_dtype == "float8_e4m3fn"
    nb = -(-hidden // FP8_BLOCK)
    ranks, placed = [], {}
    for d in range(ep_size):
        rx = np.zeros((local, ep_size * tokens, hidden), row_dtype)
        rs = np.zeros((local, ep_size * tokens, nb), np.float32) if fp8 else None
        counts = np.zeros((local, ep_size), np.int32)
        src = np.full((local, ep_size * tokens), -1, np.int32)
        for e in range(local):
            expert = d * local + e
            for s in range(ep_size):
                i = 0
                for t in range(tokens):
                    for k in range(topk):
                        if idx[s, t, k] == expert and sent[s, t, k]:
                            slot = s * tokens + i
                            rx[e, slot] = payloads[s][0][t]
                            if fp8:
                                rs[e, slot] = payloads[s][1][t]
                            src[e, slot] = t * topk + k
                            placed[(s, t, k)] = (d, e, slot)
                            i += 1
                counts[e, s] = i
        ranks.append(LLRank(rx, rs, counts, src, src >= 0))
    return LLModel(ranks, weights, idx, placed, dest_rank, num_dropped, active)


def ll_combine(y, model: LLModel, rank_mask=None) -> np.ndarray:
    """y [R, E_local, R*T, H] bfloat16 (rank d's expert outputs, slot for slot) -> [R, T, H] bfloat16.
    rank_mask (the combine's): a masked rank returns nothing and gets nothing (+0.0)."""
    y = np.asarray(y)
    ep_size, tokens, topk = model.weights.shape
    active = np.ones(ep_size, bool) if rank_mask is None else np.asarray(rank_mask) != 0
    out = np.zeros((ep_size, tokens, y.shape[3]), ml_dtypes.bfloat16)
    for s in range(ep_size):
        for t in range(tokens):
            acc = np.zeros(y.shape[3], np.float32)
            for k in range(topk):
                w = model.weights[s, t, k]
                if w != 0 and active[s] and active[model.dest_rank[s, t, k]]:
                    d, e, slot = model.placed[(s, t, k)]
                    product = (w * y[d, e, slot].astype(np.float32)).astype(np.float32)
                    acc = (acc + product).astype(np.float32)
            out[s, t] = acc.astype(ml_dtypes.bfloat16)
    return out


# ---- rank-major mode (DeepEP's contract) -----------------------------------------------------------
# One row per (source token, receiving rank) pair whose token picked any expert of that rank, packed
# from row 0 in (source rank, source token) order; R*T rows, the rest empty (zero rows, ids -1,
# weights 0, src -1). Each row: per top-k slot, the local expert id if the slot's (sanitised) expert
# lives on the receiving rank, else -1; the weight where the id is not -1, else 0.
@dataclasses.dataclass
class RankMajorRank:
    rows: np.ndarray               # [R*T, H] payload dtype
    scales: np.ndarray | None      # [R*T, nb] float32 (FP8 only)
    topk_idx: np.ndarray           # [R*T, K] int32
    topk_weights: np.ndarray       # [R*T, K] float32
    num_tokens_per_rank: np.ndarray  # [R] int32
    num_tokens_per_expert: np.ndarray  # [E_local] int32
    src: np.ndarray                # [R*T] int32 source slot s*T + t, or -1
    is_token_in_rank: np.ndarray   # [T, R] bool (source side, this rank's tokens)


def dispatch_rank_major(x, topk_idx, topk_weights, *, num_experts: int,
                        dispatch_dtype: str | None = None, rank_mask=None) -> list:
    """Global arrays [R, T, ...] -> [R] RankMajorRank. rank_mask [R] bool: rows only from active
    sources to active ranks (a masked rank sends and receives nothing)."""
    x = np.asarray(x)
    topk_weights = np.asarray(topk_weights, np.float32)
    idx = sanitize(topk_idx, num_experts)
    ep_size, tokens, topk = idx.shape
    local = num_experts // ep_size
    active = np.ones(ep_size, bool) if rank_mask is None else np.asarray(rank_mask) != 0
    payloads = [payload_of(x[s], dispatch_dtype) for s in range(ep_size)]
    out = []
    for d in range(ep_size):
        n = ep_size * tokens
        rows = np.zeros((n, x.shape[2]), payloads[0][0].dtype)
        scales = None if payloads[0][1] is None else np.zeros((n, payloads[0][1].shape[1]), np.float32)
        ids = np.full((n, topk), -1, np.int32)
        weights = np.zeros((n, topk), np.float32)
        per_rank = np.zeros(ep_size, np.int32)
        per_expert = np.zeros(local, np.int32)
        src = np.full(n, -1, np.int32)
        row = 0
        for s in range(ep_size):
            for t in range(tokens):
                here = [k for k in range(topk) if idx[s, t, k] >= 0 and idx[s, t, k] // local == d
                        and active[s] and active[d]]
                if not here:
                    continue
                rows[row] = payloads[s][0][t]
                if scales is not None:
                    scales[row] = payloads[s][1][t]
                for k in here:
                    ids[row, k] = idx[s, t, k] % local
                    weights[row, k] = topk_weights[s, t, k]
                    per_expert[idx[s, t, k] % local] += 1
                src[row] = s * tokens + t
                per_rank[s] += 1
                row += 1
        in_rank = layout(np.asarray(topk_idx)[d], num_experts, ep_size).is_token_in_rank
        out.append(RankMajorRank(rows, scales, ids, weights, per_rank, per_expert, src, in_rank))
    return out


def combine_rank_major(y, model: list) -> np.ndarray:
    """y [R, R*T, H] (rank d's output rows) -> [R, T, H] float64: per token, the sum of its rows over
    the ranks it went to (empty rows are ignored, whatever they hold)."""
    y = np.asarray(y).astype(np.float64)
    ep_size = len(model)
    tokens = y.shape[1] // ep_size
    out = np.zeros((ep_size, tokens, y.shape[2]), np.float64)
    for d, m in enumerate(model):
        for row, n in enumerate(m.src):
            if n >= 0:
                out[n // tokens, n % tokens] += y[d, row]
    return out
