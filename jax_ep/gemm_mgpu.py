"""Hopper grouped GEMM kernels (Pallas Mosaic GPU), derived from JAX's own
``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` / ``transposed_ragged_dot_mgpu`` (Apache-2.0).

What differs from JAX's kernels, and why:
  * **A tile schedule computed once** (``tile_schedule``, a few vector ops over the groups) instead of
    an unrolled loop over every group in every tile: at 128 groups that loop costs thousands of scalar
    instructions per output tile.
  * **Only live tiles are visited**: the persistent loop runs over the tiles that hold rows, so the
    capacity padding of a dispatch buffer (often half of its rows) costs no matrix work.
  * **Rows past ``sum(group_sizes)`` are written as zeros** (``lax.ragged_dot``'s semantics); JAX's
    kernel leaves them unwritten (garbage).
  * The transposed kernel (weight gradient) masks rows outside a group with a select, not a multiply,
    so non-finite garbage in padding rows cannot leak into a gradient (0 * NaN = NaN).

Semantics of both kernels are exactly those of ``lax.ragged_dot`` (f32 accumulation, output in the
operands' dtype); ``jax_ep.grouped_matmul`` (module ``jax_ep.gemm``) is the public entry point.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_ep.errors import EPValueError
from jax_ep.gemm import GROUP_MAJOR

# schedule rows (an int32 [6, tiles] array the kernel reads per tile): its group, its first row in the
# buffer, the first row and the rows it stores within the tile, and its group's first tile and number of
# tiles (for the group-major order)
_GROUP, _ROW0, _START, _SIZE, _FIRST, _COUNT = range(6)
# a tile's first row is a multiple of this: a swizzled TMA box of rows starts on a swizzle atom (8 rows of
# 128 bytes), which Mosaic GPU must see from the index expression (_tile_rows)
ROW_ALIGN = 8


def _tile_rows(row0, block_m: int):
    """The tile's rows [row0, row0 + block_m) as a slice Mosaic GPU sees start on a swizzle atom."""
    return pl.ds(row0 // ROW_ALIGN * ROW_ALIGN, block_m)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile shape of one kernel launch: output tile block_m x block_n, K step block_k,
    max_concurrent_steps TMA stages in flight. The persistent loop visits the output tiles in strips
    of grid_tile_width tiles along dimension grid_minor (0 = M, 1 = N), so that tiles running at the
    same time share operands in L2: along M they share a weight panel (what matters when there are
    many groups and each weight is used by few rows), along N they share the rows. grid_minor 2
    (GROUP_MAJOR; row-tiled passes only, width unused) visits all row tiles of one group for a column
    tile, then the next column tile, then the next group: a strip is exactly a group, so each weight
    panel is read from DRAM once however the group boundaries fall against fixed strips. ctas_per_sm
    persistent blocks share each SM (2 when their shared memory fits): one block's pipeline fill and
    epilogue then overlap the other's matrix work, which matters when tiles are short in K (the weight
    gradient, whose K is a group's rows). ring 1 (warp-specialised kernels) runs one ring of K-step
    buffers across all of a CTA's tiles instead of one pipeline per tile, so the producer loads the next
    tile's first K blocks while the consumers finish this tile and write it out. group_rows 1 (row-tiled
    passes) starts each group's row tiles at its first row instead of at the fixed blocks of block_m
    rows (tile_schedule): fewer tiles when groups do not start on a block (no effect at block_m 64 on
    64-aligned groups). out_chunks 2 (warp-specialised kernels) writes each consumer's output tile out
    in two column halves through one half-sized SMEM buffer, freeing the shared memory of another K
    stage (at a 128 x 256 CTA tile 4 x 48 KB + 32 KB): faster for the DeepSeek-V3 forward and down dx
    (H200), slower for the ring weight gradient, so a table entry's choice."""

    block_m: int = 64
    block_n: int = 256
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_minor: int = 1
    grid_tile_width: int = 2
    ctas_per_sm: int = 1
    compute_wgs: int = 1
    mma_in_flight: int = 0
    ring: int = 0
    group_rows: int = 0
    out_chunks: int = 1

    def __post_init__(self):
        if self.grid_minor not in (0, 1, GROUP_MAJOR):
            raise EPValueError(f"BlockConfig.grid_minor must be 0, 1 or {GROUP_MAJOR}, got {self.grid_minor}")
        if self.compute_wgs not in (1, 2):
            raise EPValueError(f"BlockConfig.compute_wgs must be 1 or 2, got {self.compute_wgs}")
        if self.compute_wgs == 2 and self.ctas_per_sm != 1:
            raise EPValueError("BlockConfig: the warp-specialised kernels (compute_wgs=2) run one CTA per "
                               f"SM, got ctas_per_sm={self.ctas_per_sm}")
        if self.mma_in_flight not in (0, 1) or self.mma_in_flight >= self.max_concurrent_steps:
            raise EPValueError("BlockConfig.mma_in_flight must be 0 or 1 and below max_concurrent_steps, "
                               f"got {self.mma_in_flight} with {self.max_concurrent_steps} steps")
        if self.group_rows not in (0, 1):
            raise EPValueError(f"BlockConfig.group_rows must be 0 or 1, got {self.group_rows}")
        if self.ring not in (0, 1) or (self.ring and self.compute_wgs != 2):
            raise EPValueError("BlockConfig.ring must be 0 or 1, and 1 only with compute_wgs=2, got "
                               f"ring={self.ring} with compute_wgs={self.compute_wgs}")
        if self.out_chunks not in (1, 2) or (self.out_chunks == 2 and self.compute_wgs != 2):
            raise EPValueError("BlockConfig.out_chunks must be 1 or 2, and 2 only with compute_wgs=2, got "
                               f"out_chunks={self.out_chunks} with compute_wgs={self.compute_wgs}")

    @property
    def cta_n(self) -> int:
        """Output columns one CTA computes per tile."""
        return self.block_n * self.compute_wgs

    def astuple(self):
        return dataclasses.astuple(self)


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int, zero_tail: bool = True,
                  group_rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """Which rows each M tile of the persistent loop covers.

    Rows [sum(group_sizes), m) form one extra "zero" group (id G) whose tiles store zeros; without
    zero_tail that group has no tiles (the kernel leaves those rows unwritten). A tile never spans two
    groups: it computes block_m rows from its first row and stores those of its group. Without
    group_rows the tiles are the fixed blocks of block_m rows, and a block that holds the end of one
    group and the start of the next is visited once per group; with group_rows a group's tiles start at
    its first row rounded down to ROW_ALIGN (the last one moved back to end at row m when it would pass
    it), so a group of s rows starting on ROW_ALIGN takes cdiv(s, block_m) tiles however its boundaries
    fall against the blocks (DeepSeek-V3 EP2, 128 experts of 64-aligned rows, block_m 128: 40,900 rows
    computed instead of 44,800 for 36,840 rows).
    Returns (schedule [6, cdiv(m, block_m) + G] int32: group, first row of the tile in the buffer,
    first row and rows to store within the tile, the group's first tile and its number of live tiles;
    num_tiles [1] int32: how many leading tiles are live).
    """
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    tail_end = jnp.full((1,), m, jnp.int32) if zero_tail else ends[-1:]
    ends = jnp.concatenate([ends, tail_end])                               # + the zero group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    # each group's tiles start at its first row rounded down to a block (or with group_rows to a
    # swizzle atom), block_m rows apart
    align = ROW_ALIGN if group_rows else block_m
    first = starts // align * align
    tiles = jnp.where(ends > starts, pl.cdiv(ends - first, block_m), 0)
    tile_end = jnp.cumsum(tiles)                                           # inclusive
    max_tiles = pl.cdiv(m, block_m) + g      # one extra per boundary (group_rows: never more tiles)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: one fused kernel (the default binary search is an XLA while loop on the GPU, a
    # host round trip per step: ~0.1 ms per call at decode sizes, H200 profile 2026-11-30)
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), g
                        ).astype(jnp.int32)
    base = first[group] + (t - (tile_end[group] - tiles[group])) * block_m
    lo = jnp.maximum(starts[group], base)
    hi = jnp.minimum(ends[group], base + block_m)
    # group_rows: the last tile moved back inside the buffer where that leaves it on a swizzle atom
    inside = group_rows and m >= block_m and m % ROW_ALIGN == 0
    row0 = jnp.minimum(base, m - block_m) if inside else base
    live = t < tile_end[-1]
    schedule = jnp.stack([group, jnp.where(live, row0, 0), jnp.where(live, lo - row0, 0),
                          jnp.where(live, hi - lo, 0), tile_end[group] - tiles[group], tiles[group]]
                         ).astype(jnp.int32)
    return schedule, tile_end[-1:].astype(jnp.int32)


def config_schedule(group_sizes: jax.Array, m: int, config: BlockConfig, zero_tail: bool = True):
    """tile_schedule for the row tiles of a kernel launched with `config`."""
    return tile_schedule(group_sizes, m, config.block_m, zero_tail, bool(config.group_rows))


def _num_sms(num_sms: int | None = None) -> int:
    """The SMs of a persistent grid: every SM of the GPU, or `num_sms` of them when fewer (leaving the rest
    to kernels on other streams, e.g. the EP exchanges: MoE(gemm_num_sms=...))."""
    count = jax.devices()[0].core_count if jax.default_backend() == "gpu" else 132
    return count if num_sms is None else min(num_sms, count)


def _row_tiles(schedule_gmem, num_tiles_gmem, grid_n: int, minor: int, width: int, init_carry=None):
    """The persistent loop of the ragged_dot kernels: over the live row tiles (tile_schedule) x grid_n
    column tiles, in strips of `width` tiles along `minor` (planar_snake), or group by group (minor
    GROUP_MAJOR: the linear index range of a group's tiles x grid_n holds its row tiles for column tile
    0, then 1, ...), handing the body (row tile, column tile, its group, its first row) and, with
    init_carry, the carry it returns the next one."""
    def decorator(body):
        live_m = num_tiles_gmem[0]

        @plgpu.nd_loop((live_m * grid_n,), collective_axes="sm", init_carry=init_carry)
        def _tile(loop_info: plgpu.NDLoopInfo, **carry):
            if minor == GROUP_MAJOR:
                lin = loop_info.index[0]
                first = schedule_gmem[_FIRST, lin // grid_n]
                count = schedule_gmem[_COUNT, lin // grid_n]
                local = lin - first * grid_n
                mi, ni = first + local % count, local // count
            else:
                mi, ni = plgpu.planar_snake(loop_info.index[0], (live_m, grid_n), minor, width)
            return body(mi, ni, schedule_gmem[_GROUP, mi], schedule_gmem[_ROW0, mi], *carry.values())
    return decorator


def _store_rows(o_smem, o_gmem, row0, start, size, block_m: int, col_slice, wait: bool = True):
    """Store rows [start, start + size) of the tile o_smem to rows row0 + start.. of o_gmem.

    A TMA store's box is static, so the rows go out as a ladder of power-of-two boxes (JAX's
    ragged_dot_mgpu does the same)."""
    rows = block_m
    offset = start
    while rows > 0:
        @pl.when(size & rows != 0)
        def _(offset=offset, rows=rows):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, rows)],
                                    o_gmem.at[pl.ds(row0 + offset, rows), col_slice])
        offset = offset + (size & rows)
        rows //= 2
    if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def ragged_dot(lhs, rhs, schedule, num_tiles, *, config: BlockConfig, transpose_rhs: bool = False,
               interpret=None, num_sms: int | None = None):
    """out[M, N] = lhs[M, K] @ rhs[g] (or rhs[g].T) for the rows of group g; zeros past the groups.
    num_sms: the persistent grid's SMs (_num_sms), here and in every kernel below."""
    if config.compute_wgs > 1:
        return _ragged_dot_ws(lhs, rhs, schedule, num_tiles, config=config, transpose_rhs=transpose_rhs,
                              num_sms=num_sms)
    bm, bn, bk, stages, minor, width, ctas, *_ = config.astuple()
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if transpose_rhs:
        k2, n = n, k2
    assert k == k2 and k % bk == 0 and n % bn == 0 and bm & (bm - 1) == 0, (lhs.shape, rhs.shape, config)
    grid_n = n // bn

    def body(schedule_gmem, num_tiles_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @_row_tiles(schedule_gmem, num_tiles_gmem, grid_n, minor, width)
        def _tile(mi, ni, group, row0):

            def acc_scope(acc_ref):
                @pl.when(group < g)  # the zero group (rows past the groups) skips the matmul
                def _():
                    plgpu.emit_pipeline(
                        lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                            acc_ref, lhs_smem,
                            plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem),
                        grid=(k // bk,),
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1),
                            plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                            (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                            delay_release=1),
                        ],
                        max_concurrent_steps=stages,
                    )(lhs_gmem.at[_tile_rows(row0, bm)], rhs_gmem.at[group])
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                _store_rows(o_smem, o_gmem, row0, schedule_gmem[_START, mi],
                            schedule_gmem[_SIZE, mi], min(bm, 1 << int(math.log2(m))),
                            pl.ds(ni * bn, bn))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype), grid=(ctas * _num_sms(num_sms),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret)
    return kernel(schedule, num_tiles, lhs, rhs)


def check_weight_gradient_config(config: BlockConfig):
    """Raises EPValueError where the weight-gradient kernel (transposed_ragged_dot) cannot run `config`."""
    if config.grid_minor == GROUP_MAJOR:
        raise EPValueError("transposed_ragged_dot: the group-major order is for the row-tiled passes (each "
                           f"weight gradient tile is one group already), got {config}")
    if config.compute_wgs == 2 and not config.ring and config.mma_in_flight:
        # with delay_release, JAX's pipeline producer never waits for the consumers to release the last K
        # step's slot (it quiesces to num_steps - delay_release), so after a tile of one K step (a group
        # within one K block) the next tile's prologue may refill that slot before it was read. Measured
        # (H200, 2026-12-01): faults or wrong sums whenever groups lie within one K block (64-aligned or
        # not), none when every group spans two or more. The ring releases every slot itself.
        raise EPValueError("transposed_ragged_dot: mma_in_flight=1 needs ring=1 in the warp-specialised "
                           f"weight gradient (a pipeline per tile races on one-step tiles), got {config}")


def transposed_ragged_dot(lhs, rhs, group_sizes, *, config: BlockConfig, interpret=None,
                          num_sms: int | None = None):
    """out[g] = lhs[rows of g].T @ rhs[rows of g]: lhs [M, K], rhs [M, N] -> [G, K, N] (the weight
    gradient of ragged_dot). Empty groups give zeros; rows past the groups are never read into a sum."""
    check_weight_gradient_config(config)
    if config.compute_wgs > 1:
        return _transposed_ragged_dot_ws(lhs, rhs, group_sizes, config=config, num_sms=num_sms)
    bm, bn, bk, stages, minor, width, ctas, *_ = config.astuple()
    rows, k = lhs.shape
    rows2, n = rhs.shape
    g = group_sizes.shape[0]
    assert rows == rows2 and k % bm == 0 and n % bn == 0, (lhs.shape, rhs.shape, config)
    info = _group_row_blocks(group_sizes, rows, bk)

    transforms = _smem_transforms(lhs.dtype, bk)
    grid_m, grid_n = k // bm, n // bn

    def body(info_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @_group_tiles(info_gmem, g, (grid_m, grid_n), minor, width, bk)
        def _tile(gi, mi, ni, start, end, num_k, first_row):

            def acc_scope(acc_ref):
                def step(idx, lhs_smem, rhs_smem):
                    _mask_cut_block(lhs_smem, rhs_smem, idx[0], num_k, start, end, first_row, bk)
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_smem, (1, 0)), rhs_smem)
                    if stages == 1:
                        plgpu.wgmma_wait(0)

                @pl.when(num_k > 0)
                def _():
                    plgpu.emit_pipeline(
                        step, grid=(num_k,),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda kk: (kk, mi), transforms=transforms,
                                            delay_release=1 if stages > 1 else 0),
                            plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), transforms=transforms,
                                            delay_release=1 if stages > 1 else 0),
                        ],
                        max_concurrent_steps=stages,
                    # the slice may run past the end of the rows; the pipeline never reads past num_k
                    )(lhs_gmem.at[pl.ds(first_row, rows)], rhs_gmem.at[pl.ds(first_row, rows)])
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped,
                               o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype, transforms=transforms))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((g, k, n), lhs.dtype), grid=(ctas * _num_sms(num_sms),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret)
    return kernel(info, lhs, rhs)


def _group_tiles(info_gmem, g: int, grid, minor: int, width: int, bk: int):
    """The persistent loop of the weight-gradient kernels: over (group, output tile of the grid), the
    tiles in strips (planar_snake), handing the body (group, tile row, tile column) and the group's
    _group_row_blocks entry (first row, end row, K blocks, first row of its first block)."""
    def decorator(body):
        @plgpu.nd_loop((g, grid[0] * grid[1]), collective_axes="sm")
        def _tile(loop_info: plgpu.NDLoopInfo):
            gi = loop_info.index[0]
            mi, ni = plgpu.planar_snake(loop_info.index[1], grid, minor, width)
            start, end = info_gmem[0, gi], info_gmem[1, gi]
            num_k = info_gmem[2, gi]
            body(gi, mi, ni, start, end, num_k, pl.multiple_of(info_gmem[3, gi], bk))
    return decorator


def _group_row_blocks(group_sizes, rows: int, bk: int):
    """Per group: first row, end row, K blocks of bk rows it touches, first row of its first block
    ([4, G] int32; the weight-gradient kernels' K loop)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    block_starts = starts // bk * bk
    num_blocks = jnp.where(ends > starts, -(ends // -bk) - starts // bk, 0)
    return jnp.stack([starts, ends, num_blocks, block_starts]).astype(jnp.int32)


def _smem_transforms(dtype, minor_elems: int):
    """Tiling + swizzle of an SMEM tile whose minor dimension holds minor_elems elements."""
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _acc_zeros(bm: int, bn: int):
    """A float32 zero tile in the WGMMA accumulator layout (the start of a register-carried sum)."""
    return plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)


def _acc_ref_context(bm: int, bn: int, store):
    """A per-tile warp-specialised pipeline's compute context: the tile's K steps accumulate into a
    fresh (bm, bn) float32 WGMMA accumulator, then store(its values) writes the tile out."""
    def compute_context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
            run(acc_ref)
            store(acc_ref[...])
    return compute_context


def _write_tile(o_smem, values):
    """values -> the output tile o_smem, once the previous TMA store from it has read it."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = values.astype(o_smem.dtype)
    plgpu.commit_smem()


def _write_chunks(o_smem, values, col0, store):
    """values [bm, bn], the output's columns from col0, out through o_smem [bm, bn / chunks] one column
    chunk at a time (BlockConfig.out_chunks): each waits for the previous TMA store from o_smem to have
    read it; store(cols) issues the store of the chunk now in o_smem to the output's columns `cols`."""
    width = o_smem.shape[-1]
    chunks = values.shape[1] // width
    for c in range(chunks):
        _write_tile(o_smem, values if chunks == 1 else values[:, c * width:(c + 1) * width])
        store(pl.ds(col0 + c * width, width))


def _ws_kernel(body, out_type, num_sms: int | None):
    return plgpu.kernel(
        body, out_type=out_type, grid=(_num_sms(num_sms),), grid_names=("sm",), num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


# Registers the producer warpgroup keeps; the consumers share the rest (JAX's Hopper matmul uses 40).
_PRODUCER_REGISTERS = 40


def _ws_pipeline(step, compute_context, *, in_specs, grid, wgs: int, stages: int):
    """A warp-specialised pipeline: the producer warpgroup (the last) loads in_specs' blocks, `stages`
    ahead, while `wgs` consumer warpgroups run `step` on them."""
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=grid, memory_registers=_PRODUCER_REGISTERS, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute_context)


def _no_body(*_, **__):
    """The body of a pipeline built only for its allocations."""


def _settle_mma(kk, num_k, delay: int):
    """After K step kk (of num_k) of a per-tile warp-specialised pipeline issued its WGMMA: wait until
    `delay` are left in flight, and none after the tile's last step. With delay_release, JAX's pipeline
    releases a step's slot one step later and never the last step's (its producer quiesces to num_steps -
    delay_release), so the next tile's prologue may refill that slot: its WGMMA must be done by the time
    the consumer releases the step before it, which the producer waits for."""
    plgpu.wgmma_wait(delay)
    if delay:
        @pl.when(kk == num_k - 1)
        def _():
            plgpu.wgmma_wait(0)


def _ws_scope(allocations, o_smem):
    """Decorator of a warp-specialised kernel's body(allocs, o_smem, wg): it runs in every warpgroup
    with the pipeline's SMEM (`allocations`: a pipeline's get_allocations, reused by the pipeline of every
    tile) and the consumers' output tiles (`o_smem`) allocated once; at the end every warpgroup waits for
    its last TMA stores to have read their tiles."""
    def decorator(body):
        @functools.partial(pl.run_scoped, allocs=allocations, o_smem=o_smem, collective_axes="wg")
        def _scope(allocs, o_smem):
            body(allocs, o_smem, lax.axis_index("wg"))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return decorator


def _k_ring(tiles, operands, load, mma, epilogue, *, stages: int, wgs: int, delay: int, scratch,
            acc_shape=None, init_acc=None, pairs: bool = False):
    """The body of a warp-specialised kernel whose K-step buffers form one ring across all of the CTA's
    tiles, instead of one pipeline per tile.

    A pipeline per tile drains at every tile: its producer waits for the consumers to finish the tile
    before it loads the next one's first blocks, so each tile pays the load latency again; a weight
    gradient tile is only a group's rows deep (DeepSeek-V3: 4-5 K steps), a forward tile at K 2048 32.
    Here the producer warpgroup runs ahead across tile boundaries; the step counter carried through both
    sides' tile loops names the slot, and so the barrier phase, each side is at.

    tiles(body): runs body(tile, step) -> step over the CTA's tiles (tile: what the other callbacks get;
    tile.num_k its K steps). operands: (shape, dtype, transforms) of each operand's block.
    load(tile, kk, blocks, barrier): the TMA copies of K step kk into `blocks`, arriving on `barrier`.
    mma(tile, kk, blocks, acc, wg): consumer wg's matrix work on them, into a WGMMA accumulator of
    acc_shape (acc: its ref, starting at zero) or, with init_acc, into a sum carried in registers (acc:
    its value, init_acc() the first; mma returns the next; the FP8 kernels' promotion). delay: WGMMAs
    left in flight after a step (each step's slot is released once its MMA is done).
    epilogue(tile, acc, wg, scratch): write the tile (acc: the final sum; a tile of no K steps stores the
    initial one, zeros). scratch: the consumers' own SMEM (the output tiles). pairs (with init_acc): the
    consumers' K loop runs two steps per iteration (the odd one after), so that values a step carries to
    the next (the lagged FP8 promotion's block sum) alternate between two register sets instead of being
    copied back into one."""
    consumer_registers = int(min(256, (512 - _PRODUCER_REGISTERS) / wgs) // 8 * 8)

    @functools.partial(
        pl.run_scoped,
        bufs=[plgpu.SMEM((stages, *shape), dtype, transforms=tf) for shape, dtype, tf in operands],
        scratch=scratch,
        full=plgpu.Barrier(num_arrivals=len(operands), num_barriers=stages),
        empty=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        collective_axes="wg")
    def _scope(bufs, scratch, full, empty):
        wg = lax.axis_index("wg")

        @pl.when(wg == wgs)
        def _producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            @tiles
            def _tile(tile, step):
                def one(kk, s):
                    slot = lax.rem(s, stages)

                    @pl.when(s >= stages)       # the ring's first lap finds every slot empty
                    def _():
                        plgpu.barrier_wait(empty.at[slot])
                    load(tile, kk, [b.at[slot] for b in bufs], full.at[slot])
                    return s + 1
                return lax.fori_loop(0, tile.num_k, one, step)

        @pl.when(wg < wgs)
        def _consumer():
            plgpu.set_max_registers(consumer_registers, action="increase")

            def consume(tile, step, acc, step_fn):
                def one(kk, carry):
                    s, acc = carry
                    slot = lax.rem(s, stages)
                    plgpu.barrier_wait(full.at[slot])
                    acc = step_fn(kk, [b.at[slot] for b in bufs], acc)
                    plgpu.wgmma_wait(delay)
                    if delay:               # the previous step's MMA is done with its slot
                        @pl.when(kk > 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[lax.rem(s - 1, stages)])
                    else:
                        plgpu.barrier_arrive(empty.at[slot])
                    return s + 1, acc
                if pairs:
                    carry = lax.fori_loop(0, tile.num_k // 2, lambda j, c: one(2 * j + 1, one(2 * j, c)),
                                          (step, acc))
                    end_step, acc = lax.cond(tile.num_k % 2 == 1, lambda c: one(tile.num_k - 1, c),
                                             lambda c: c, carry)
                else:
                    end_step, acc = lax.fori_loop(0, tile.num_k, one, (step, acc))
                if delay:
                    plgpu.wgmma_wait(0)

                    @pl.when(tile.num_k > 0)
                    def _():
                        plgpu.barrier_arrive(empty.at[lax.rem(end_step - 1, stages)])
                return end_step, acc

            @tiles
            def _tile(tile, step):
                if init_acc is not None:
                    end_step, acc = consume(tile, step, init_acc(),
                                            lambda kk, blocks, acc: mma(tile, kk, blocks, acc, wg))
                    epilogue(tile, acc, wg, scratch)
                    return end_step

                def scoped(acc_ref):
                    def add(kk, blocks, _):     # the ref is not carried: the steps add into it
                        mma(tile, kk, blocks, acc_ref, wg)

                    end_step, _ = consume(tile, step, None, add)
                    epilogue(tile, acc_ref[...], wg, scratch)
                    return end_step
                return pl.run_scoped(scoped, plgpu.ACC(acc_shape, jnp.float32))

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


class _GroupTile(NamedTuple):
    """A weight-gradient tile: group gi's output block (mi, ni), the group's rows [start, end) in num_k
    K blocks from first_row."""
    gi: jax.Array
    mi: jax.Array
    ni: jax.Array
    start: jax.Array
    end: jax.Array
    num_k: jax.Array
    first_row: jax.Array


class _RowTile(NamedTuple):
    """A ragged_dot tile: row tile mi (its group and block of rows) x column tile ni, num_k K steps (none
    for the rows past the groups: zeros)."""
    mi: jax.Array
    ni: jax.Array
    group: jax.Array
    row0: jax.Array
    num_k: jax.Array


def _row_ring_tiles(schedule_gmem, num_tiles_gmem, grid_n: int, minor: int, width: int, g: int, num_k: int):
    """_k_ring's tile loop over the ragged_dot kernels' tiles (_row_tiles): num_k K steps each, none for
    the rows past the groups (zeros, no matrix work)."""
    def tiles(tile_body):
        @_row_tiles(schedule_gmem, num_tiles_gmem, grid_n, minor, width, init_carry=jnp.int32(0))
        def _tile(mi, ni, group, row0, carry):
            steps = jnp.where(group < g, num_k, 0).astype(jnp.int32)
            return tile_body(_RowTile(mi, ni, group, row0, steps), carry)
    return tiles


def _group_ring_tiles(info_gmem, g: int, grid, minor: int, width: int, bk: int):
    """_k_ring's tile loop over the weight-gradient kernels' tiles (as _group_tiles), as _GroupTiles."""
    def tiles(tile_body):
        @plgpu.nd_loop((g, grid[0] * grid[1]), collective_axes="sm", init_carry=jnp.int32(0))
        def _tile(loop_info: plgpu.NDLoopInfo, carry):
            gi = loop_info.index[0]
            mi, ni = plgpu.planar_snake(loop_info.index[1], grid, minor, width)
            return tile_body(_GroupTile(gi, mi, ni, info_gmem[0, gi], info_gmem[1, gi], info_gmem[2, gi],
                                        pl.multiple_of(info_gmem[3, gi], bk)), carry)
    return tiles


def _ragged_dot_ws(lhs, rhs, schedule, num_tiles, *, config: BlockConfig, transpose_rhs: bool,
                   num_sms: int | None):
    """ragged_dot with a producer warpgroup and config.compute_wgs consumers side by side along N: a
    pipeline per tile, or with config.ring one ring of K-step buffers across the CTA's tiles (_k_ring)."""
    bm, bn, bk, stages, minor, width, _, wgs, delay, *_ = config.astuple()
    chunks = config.out_chunks
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if transpose_rhs:
        k2, n = n, k2
    cta_n = config.cta_n
    assert k == k2 and k % bk == 0 and n % cta_n == 0 and bm & (bm - 1) == 0, (lhs.shape, rhs.shape, config)
    if k // bk == 1 and not config.ring:
        # one K step leaves a WGMMA in flight nothing to overlap, and a per-tile pipeline of one step with
        # delay_release races (check_weight_gradient_config): wait for it at once
        delay = 0
    grid_n = n // cta_n
    tf = _smem_transforms(lhs.dtype, bk)
    rhs_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)
    rhs_index = (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0))
    ladder = min(bm, 1 << int(math.log2(m)))

    def ring_body(schedule_gmem, num_tiles_gmem, lhs_gmem, rhs_gmem, o_gmem):
        tiles = _row_ring_tiles(schedule_gmem, num_tiles_gmem, grid_n, minor, width, g, k // bk)

        def load(t, kk, blocks, barrier):
            cols, ks = pl.ds(t.ni * cta_n, cta_n), pl.ds(kk * bk, bk)
            plgpu.copy_gmem_to_smem(lhs_gmem.at[_tile_rows(t.row0, bm), ks], blocks[0], barrier)
            panel = rhs_gmem.at[t.group, cols, ks] if transpose_rhs else rhs_gmem.at[t.group, ks, cols]
            plgpu.copy_gmem_to_smem(panel, blocks[1], barrier)

        def mma(t, kk, blocks, acc_ref, wg):
            mine = pl.ds(wg * bn, bn)
            b = plgpu.transpose_ref(blocks[1].at[mine], (1, 0)) if transpose_rhs else blocks[1].at[:, mine]
            plgpu.wgmma(acc_ref, blocks[0], b)

        # the output tile goes out through SMEM without swizzle: a ragged tile is stored as a ladder of
        # row boxes that can start on any row
        def epilogue(t, acc, wg, o_smem):
            start, size = schedule_gmem[_START, t.mi], schedule_gmem[_SIZE, t.mi]
            _write_chunks(o_smem.at[wg], acc, t.ni * cta_n + wg * bn, lambda cols: _store_rows(
                o_smem.at[wg], o_gmem, t.row0, start, size, ladder, cols, wait=False))

        _k_ring(tiles, [((bm, bk), lhs.dtype, tf), (rhs_block, rhs.dtype, tf)], load, mma, epilogue,
                stages=stages, wgs=wgs, delay=delay, acc_shape=(bm, bn),
                scratch=plgpu.SMEM((wgs, bm, bn // chunks), o_gmem.dtype))

    if config.ring:
        return _ws_kernel(ring_body, jax.ShapeDtypeStruct((m, n), lhs.dtype), num_sms)(
            schedule, num_tiles, lhs, rhs)

    def get_pipeline(step, compute_context):
        return _ws_pipeline(
            step, compute_context, grid=(k // bk,), wgs=wgs, stages=stages,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tf, memory_space=plgpu.SMEM,
                                      delay_release=delay),
                      plgpu.BlockSpec(rhs_block, rhs_index, transforms=tf, memory_space=plgpu.SMEM,
                                      delay_release=delay)])

    def body(schedule_gmem, num_tiles_gmem, lhs_gmem, rhs_gmem, o_gmem):
        rhs_panel = rhs_gmem.at[0, pl.ds(0, cta_n)] if transpose_rhs else rhs_gmem.at[0, :, pl.ds(0, cta_n)]

        # the output tile goes out through SMEM without swizzle: a ragged tile is stored as a ladder of
        # row boxes that can start on any row
        @_ws_scope(get_pipeline(_no_body, _no_body).get_allocations(lhs_gmem.at[pl.ds(0, bm)], rhs_panel),
                   plgpu.SMEM((wgs, bm, bn // chunks), o_gmem.dtype))
        def _scope(allocs, o_smem, wg):
            @_row_tiles(schedule_gmem, num_tiles_gmem, grid_n, minor, width)
            def _tile(mi, ni, group, row0):
                def store(values):
                    start, size = schedule_gmem[_START, mi], schedule_gmem[_SIZE, mi]
                    _write_chunks(o_smem.at[wg], values, ni * cta_n + wg * bn, lambda cols: _store_rows(
                        o_smem.at[wg], o_gmem, row0, start, size, ladder, cols, wait=False))

                compute_context = _acc_ref_context(bm, bn, store)

                def step(kk, lhs_smem, rhs_smem, acc_ref):
                    if transpose_rhs:
                        b = plgpu.transpose_ref(rhs_smem.at[pl.ds(wg * bn, bn)], (1, 0))
                    else:
                        b = rhs_smem.at[:, pl.ds(wg * bn, bn)]
                    plgpu.wgmma(acc_ref, lhs_smem, b)
                    _settle_mma(kk[0], k // bk, delay)
                    return acc_ref

                @pl.when(group < g)
                def _():
                    panel = (rhs_gmem.at[group, pl.ds(ni * cta_n, cta_n)] if transpose_rhs
                             else rhs_gmem.at[group, :, pl.ds(ni * cta_n, cta_n)])
                    get_pipeline(step, compute_context)(lhs_gmem.at[_tile_rows(row0, bm)], panel,
                                                        allocations=allocs)

                @pl.when((group >= g) & (wg < wgs))  # rows past the groups: zeros, no matrix work
                def _():
                    store(jnp.zeros((bm, bn), jnp.float32))

    kernel = _ws_kernel(body, jax.ShapeDtypeStruct((m, n), lhs.dtype), num_sms)
    return kernel(schedule, num_tiles, lhs, rhs)


def _mask_outside(lhs_smem, rhs_smem, when, lo, hi):
    """When `when`: rows outside [lo, hi) of both operands' K block -> 0, a select, so NaN garbage in
    another group's or padding rows stays out of the sum (0 * NaN = NaN)."""
    @pl.when(when)
    def _():
        for ref in (lhs_smem, rhs_smem):
            reg = ref[...]
            i = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, reg.shape, 0), plgpu.Layout.WGMMA)
            ref[...] = jnp.where((i >= lo) & (i < hi), reg, (i < 0).astype(reg.dtype))
        plgpu.commit_smem()


def _mask_cut_block(lhs_smem, rhs_smem, kb, num_k, start, end, first_row, bk: int):
    """K block kb of a group's rows [start, end) (its blocks start at first_row): only a block that a
    group boundary cuts holds rows of another group or padding, so only the first and last, and only
    when the boundary is not a multiple of bk, are masked."""
    row0 = first_row + kb * bk
    cut = ((kb == 0) & (start % bk != 0)) | ((kb == num_k - 1) & (end % bk != 0))
    _mask_outside(lhs_smem, rhs_smem, cut, start - row0, end - row0)


def _transposed_ragged_dot_ws(lhs, rhs, group_sizes, *, config: BlockConfig, num_sms: int | None):
    """transposed_ragged_dot with a producer warpgroup and config.compute_wgs consumers along N: while
    the consumers write one output tile, the producer already loads the next tile's rows."""
    bm, bn, bk, stages, minor, width, _, wgs, delay, *_ = config.astuple()
    chunks = config.out_chunks
    rows, k = lhs.shape
    rows2, n = rhs.shape
    g = group_sizes.shape[0]
    cta_n = config.cta_n
    assert rows == rows2 and k % bm == 0 and n % cta_n == 0, (lhs.shape, rhs.shape, config)
    info = _group_row_blocks(group_sizes, rows, bk)
    lhs_tf = _smem_transforms(lhs.dtype, bm)
    rhs_tf = _smem_transforms(rhs.dtype, cta_n)
    out_tf = _smem_transforms(lhs.dtype, bn // chunks)
    grid_m, grid_n = k // bm, n // cta_n

    def ring_body(info_gmem, lhs_gmem, rhs_gmem, o_gmem):
        tiles = _group_ring_tiles(info_gmem, g, (grid_m, grid_n), minor, width, bk)

        def load(t, kk, blocks, barrier):
            row = pl.ds(t.first_row + kk * bk, bk)          # past the last row: TMA fills zeros
            plgpu.copy_gmem_to_smem(lhs_gmem.at[row, pl.ds(t.mi * bm, bm)], blocks[0], barrier)
            plgpu.copy_gmem_to_smem(rhs_gmem.at[row, pl.ds(t.ni * cta_n, cta_n)], blocks[1], barrier)

        def mma(t, kk, blocks, acc_ref, wg):
            lhs_block, rhs_mine = blocks[0], blocks[1].at[:, pl.ds(wg * bn, bn)]
            # every consumer masks the shared lhs block itself (the same values), so none reads it
            # unmasked
            _mask_cut_block(lhs_block, rhs_mine, kk, t.num_k, t.start, t.end, t.first_row, bk)
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_block, (1, 0)), rhs_mine)

        def epilogue(t, acc, wg, o_smem):
            _write_chunks(o_smem.at[wg], acc, t.ni * cta_n + wg * bn, lambda cols: plgpu.copy_smem_to_gmem(
                o_smem.at[wg], o_gmem.at[t.gi, pl.ds(t.mi * bm, bm), cols]))

        _k_ring(tiles, [((bk, bm), lhs.dtype, _smem_transforms(lhs.dtype, bm)),
                        ((bk, cta_n), rhs.dtype, _smem_transforms(rhs.dtype, cta_n))],
                load, mma, epilogue, stages=stages, wgs=wgs, delay=delay, acc_shape=(bm, bn),
                scratch=plgpu.SMEM((wgs, bm, bn // chunks), lhs.dtype, transforms=out_tf))

    if config.ring:
        return _ws_kernel(ring_body, jax.ShapeDtypeStruct((g, k, n), lhs.dtype), num_sms)(info, lhs, rhs)

    # a pipeline per tile: no WGMMA left in flight (check_weight_gradient_config), so each step's slot is
    # released at once
    def get_pipeline(step, compute_context, num_k):
        return _ws_pipeline(
            step, compute_context, grid=(num_k,), wgs=wgs, stages=stages,
            in_specs=[plgpu.BlockSpec((bk, bm), lambda kk: (kk, 0), transforms=lhs_tf,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((bk, cta_n), lambda kk: (kk, 0), transforms=rhs_tf,
                                      memory_space=plgpu.SMEM)])

    def body(info_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @_ws_scope(get_pipeline(_no_body, _no_body, stages).get_allocations(
                       lhs_gmem.at[pl.ds(0, bk), pl.ds(0, bm)], rhs_gmem.at[pl.ds(0, bk), pl.ds(0, cta_n)]),
                   plgpu.SMEM((wgs, bm, bn // chunks), o_gmem.dtype, transforms=out_tf))
        def _scope(allocs, o_smem, wg):
            @_group_tiles(info_gmem, g, (grid_m, grid_n), minor, width, bk)
            def _tile(gi, mi, ni, start, end, num_k, first_row):
                def store(values):
                    _write_chunks(o_smem.at[wg], values, ni * cta_n + wg * bn,
                                  lambda cols: plgpu.copy_smem_to_gmem(
                                      o_smem.at[wg], o_gmem.at[gi, pl.ds(mi * bm, bm), cols]))

                compute_context = _acc_ref_context(bm, bn, store)

                def step(idx, lhs_smem, rhs_smem, acc_ref):
                    rhs_mine = rhs_smem.at[:, pl.ds(wg * bn, bn)]
                    # every consumer masks the shared lhs tile itself (the same values), so none
                    # reads it unmasked
                    _mask_cut_block(lhs_smem, rhs_mine, idx[0], num_k, start, end, first_row, bk)
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_smem, (1, 0)), rhs_mine)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                @pl.when(num_k > 0)
                def _():
                    # the slices may run past the last row; the pipeline never reads past num_k blocks
                    get_pipeline(step, compute_context, num_k)(
                        lhs_gmem.at[pl.ds(first_row, rows), pl.ds(mi * bm, bm)],
                        rhs_gmem.at[pl.ds(first_row, rows), pl.ds(ni * cta_n, cta_n)],
                        allocations=allocs)

                @pl.when((num_k == 0) & (wg < wgs))  # an empty group's gradient is zero
                def _():
                    store(jnp.zeros((bm, bn), jnp.float32))

    kernel = _ws_kernel(body, jax.ShapeDtypeStruct((g, k, n), lhs.dtype), num_sms)
    return kernel(info, lhs, rhs)


# FP8 blocks: DeepSeek-V3's layout. Activations carry one scale per row and 128 channels, weights one per
# 128 x 128 block, so a K step of 128 meets one scale per row and one per output tile of 128 columns.
FP8_K_BLOCK = 128


def _fp8_block_sum(a_smem, b_smem, b_block: tuple | None = None, under=None):
    """One K step's float32 block sum a [bm, 128] . b [bn, 128]^T (both e4m3, K-major; b_block (i, bn):
    only b's i-th block of bn rows, e.g. this consumer's columns) in its own WGMMA accumulator: what the
    FP8 kernels promote into their running sums. ``under``: a function computed while the WGMMAs run
    (after they are issued, before they are waited for); then (its value, the block sum)."""
    bn = b_smem.shape[0] if b_block is None else b_block[1]

    def mma(acc_ref):
        b_mine = b_smem if b_block is None else b_smem.at[pl.ds(b_block[0] * bn, bn)]
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_mine, (1, 0)))
        return acc_ref[...] if under is None else (under(), acc_ref[...])

    return pl.run_scoped(mma, plgpu.ACC((a_smem.shape[0], bn), jnp.float32))


def _promote(total, part, scale):
    """DeepSeek-V3's promotion: a K step's float32 block sum, scaled per row (``scale`` [block_m]: the
    row's scale times the weight block's), added to the running sum."""
    return total + part * lax.broadcast_in_dim(scale, part.shape, (0,))


def ragged_dot_fp8(xq, xs_t, wq_t, ws, schedule, num_tiles, *, block_m: int = 64, stages: int = 4,
                   out_dtype=jnp.bfloat16, warp_specialized: bool = False, grid_minor: int = 0,
                   ring: bool = False, scales_smem: bool = False, lagged: bool = False,
                   num_sms: int | None = None):
    """out[r] = sum over K blocks kb of xs[r, kb] * ws[g, kb, n // 128] * (xq[r, kb] . wq[g, kb, n]) for
    the rows r of group g (f32 sums, out_dtype out; zeros past the groups).

    xq [M, K] float8_e4m3fn rows; xs_t [K/128, M] float32 their scales, transposed (a K step reads one
    contiguous row of scales); wq_t [G, N, K] float8_e4m3fn the weights with K minor (FP8 WGMMA takes both
    operands K-major); ws [G, K/128, N/128] float32 the weights' 128 x 128 block scales. Each K step runs
    in its own accumulator, scaled and added to a running sum in registers (the "promotion" of
    DeepSeek-V3's FP8 GEMM: the scales change every 128 channels). The same kernel computes the FP8 input
    gradient: dy's rows and scales with the weights in [G, K, N] layout as wq_t and ws transposed.
    warp_specialized: a producer warpgroup loads while two consumers each compute 128 of the CTA's 256
    columns (block_m x 256 tiles, one weight scale per consumer and K step). grid_minor: the tile order,
    strips of 4 row tiles (0) or group by group (GROUP_MAJOR; see BlockConfig). ring (warp-specialised
    only): one ring of K-step buffers across the CTA's tiles (see BlockConfig). scales_smem (ring only):
    the producer copies each K step's row of weight scales into the ring beside the blocks, so the
    consumers read it from SMEM instead of global memory after their WGMMAs (ncu, session 32: ~10% of the
    warps' stalls were that load). lagged (ring only): each K step's block sum is promoted while the next
    step's WGMMAs run (issued first, waited for after), the consumers' K loop two steps per iteration so
    that the two block sums in flight sit in two register sets; the same sums in the same order, so the
    same results bit for bit (H200, tools/fp8_bounds.py, three runs on 2026-12-01: 1.1-3.7% faster on
    average on the four DeepSeek-V3 FP8 passes; one step per iteration was 7-20% slower: 64 register
    moves copy the carried block sum out of the accumulator's registers each step)."""
    assert warp_specialized or not ring, "the K ring is a warp-specialised form (gemm_fp8.fp8_kernel_form)"
    assert ring or not (scales_smem or lagged), "scales_smem, lagged: K-ring forms (gemm_fp8.fp8_kernel_form)"
    if warp_specialized:
        return _ragged_dot_fp8_ws(xq, xs_t, wq_t, ws, schedule, num_tiles, block_m=block_m, stages=stages,
                                  out_dtype=out_dtype, grid_minor=grid_minor, ring=ring,
                                  scales_smem=scales_smem, lagged=lagged, num_sms=num_sms)
    m, k = xq.shape
    g, n, k2 = wq_t.shape
    bm, bn, bk = block_m, FP8_K_BLOCK, FP8_K_BLOCK
    assert k == k2 and k % bk == 0 and n % bn == 0 and bm in (64, 128), (xq.shape, wq_t.shape, bm)
    assert xs_t.shape == (k // bk, m) and ws.shape == (g, k // bk, n // bn), (xs_t.shape, ws.shape)
    grid_n = n // bn
    ladder = min(bm, 1 << int(math.log2(m)))

    def body(schedule_gmem, num_tiles_gmem, x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem):
        @_row_tiles(schedule_gmem, num_tiles_gmem, grid_n, grid_minor, 4)
        def _tile(mi, ni, group, row0):

            def step(idx, x_smem, w_smem, s_smem, total):
                # the scales are read after the block sum: reading them first (so the weight scale's
                # global load runs under the WGMMAs) timed 4-9% slower on the H200 (session 33)
                part = _fp8_block_sum(x_smem, w_smem)
                rows = plgpu.load(s_smem, (0,), layout=plgpu.Layout.WGMMA.reduce(1))
                return _promote(total, part, rows * ws_gmem[group, idx[0], ni])

            def matmul():
                return plgpu.emit_pipeline(
                    step, grid=(k // bk,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk)),
                              plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk)),
                              plgpu.BlockSpec((1, bm), lambda kk: (kk, 0))],
                    max_concurrent_steps=stages,
                    init_carry=_acc_zeros(bm, bn),
                )(x_gmem.at[_tile_rows(row0, bm)], w_gmem.at[group], xs_gmem.at[:, _tile_rows(row0, bm)])

            # the zero group (rows past the groups) does no matrix work
            total = lax.cond(group < g, matmul, lambda: _acc_zeros(bm, bn))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype))
            def _store(o_smem):
                o_smem[...] = total.astype(o_smem.dtype)
                plgpu.commit_smem()
                _store_rows(o_smem, o_gmem, row0, schedule_gmem[_START, mi], schedule_gmem[_SIZE, mi],
                            ladder, pl.ds(ni * bn, bn))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(_num_sms(num_sms),), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(schedule, num_tiles, xq, xs_t, wq_t, ws)


def _ragged_dot_fp8_ws(xq, xs_t, wq_t, ws, schedule, num_tiles, *, block_m: int, stages: int, out_dtype,
                       grid_minor: int, ring: bool = False, scales_smem: bool = False, lagged: bool = False,
                       num_sms: int | None = None):
    """ragged_dot_fp8 with a producer warpgroup and two consumers side by side along N; with `ring`, one
    ring of K-step buffers across the CTA's tiles (_k_ring) instead of a pipeline per tile; `lagged`: see
    ragged_dot_fp8."""
    m, k = xq.shape
    g, n, k2 = wq_t.shape
    wgs, bm, bn, bk = 2, block_m, FP8_K_BLOCK, FP8_K_BLOCK
    cta_n = wgs * bn
    assert k == k2 and k % bk == 0 and n % cta_n == 0 and bm in (64, 128), (xq.shape, wq_t.shape, bm)
    assert xs_t.shape == (k // bk, m) and ws.shape == (g, k // bk, n // bn), (xs_t.shape, ws.shape)
    grid_n = n // cta_n
    tf = _smem_transforms(xq.dtype, bk)
    ladder = min(bm, 1 << int(math.log2(m)))

    # each ring slot's scale row starts 128-byte aligned (a TMA destination; 224-byte rows faulted with a
    # misaligned address on the H200): the rows padded to 32 floats
    ws_cols = -(-ws.shape[2] // 32) * 32 if scales_smem else ws.shape[2]
    if ws_cols != ws.shape[2]:
        ws = jnp.pad(ws, ((0, 0), (0, 0), (0, ws_cols - ws.shape[2])))

    def ring_body(schedule_gmem, num_tiles_gmem, x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem):
        def load(t, kk, blocks, barrier):
            ks = pl.ds(kk * bk, bk)
            plgpu.copy_gmem_to_smem(x_gmem.at[_tile_rows(t.row0, bm), ks], blocks[0], barrier)
            plgpu.copy_gmem_to_smem(w_gmem.at[t.group, pl.ds(t.ni * cta_n, cta_n), ks], blocks[1], barrier)
            plgpu.copy_gmem_to_smem(xs_gmem.at[pl.ds(kk, 1), _tile_rows(t.row0, bm)], blocks[2], barrier)
            if scales_smem:
                plgpu.copy_gmem_to_smem(ws_gmem.at[t.group, pl.ds(kk, 1)], blocks[3], barrier)

        def scale(t, kk, blocks, wg):
            rows = plgpu.load(blocks[2], (0,), layout=plgpu.Layout.WGMMA.reduce(1))
            col = t.ni * wgs + wg
            return rows * (blocks[3][0, col] if scales_smem else ws_gmem[t.group, kk, col])

        def mma(t, kk, blocks, total, wg):
            part = _fp8_block_sum(blocks[0], blocks[1], (wg, bn))
            return _promote(total, part, scale(t, kk, blocks, wg))

        def mma_lagged(t, kk, blocks, carry, wg):
            # carry: the running sum, the previous step's block sum and its scale (zeros before the first)
            total, last, last_scale = carry
            step_scale = scale(t, kk, blocks, wg)
            total, part = _fp8_block_sum(blocks[0], blocks[1], (wg, bn),
                                         under=lambda: _promote(total, last, last_scale))
            return total, part, step_scale

        def lagged_zeros():
            return (_acc_zeros(bm, bn), _acc_zeros(bm, bn),
                    plgpu.layout_cast(jnp.zeros((bm,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))

        def epilogue(t, total, wg, o_smem):
            if lagged:
                total = _promote(*total)
            _write_tile(o_smem.at[wg], total)
            _store_rows(o_smem.at[wg], o_gmem, t.row0, schedule_gmem[_START, t.mi],
                        schedule_gmem[_SIZE, t.mi], ladder, pl.ds((t.ni * wgs + wg) * bn, bn), wait=False)

        _k_ring(_row_ring_tiles(schedule_gmem, num_tiles_gmem, grid_n, grid_minor, 4, g, k // bk),
                [((bm, bk), xq.dtype, tf), ((cta_n, bk), wq_t.dtype, tf), ((1, bm), xs_t.dtype, ()),
                 *([((1, ws_cols), ws.dtype, ())] if scales_smem else [])],
                load, mma_lagged if lagged else mma, epilogue, stages=stages, wgs=wgs, delay=0,
                scratch=plgpu.SMEM((wgs, bm, bn), out_dtype),
                init_acc=lagged_zeros if lagged else lambda: _acc_zeros(bm, bn), pairs=lagged)

    if ring:
        kernel = _ws_kernel(ring_body, jax.ShapeDtypeStruct((m, n), out_dtype), num_sms)
        return kernel(schedule, num_tiles, xq, xs_t, wq_t, ws)

    def get_pipeline(step, compute_context):
        return _ws_pipeline(
            step, compute_context, grid=(k // bk,), wgs=wgs, stages=stages,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tf, memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((cta_n, bk), lambda kk: (0, kk), transforms=tf,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((1, bm), lambda kk: (kk, 0), memory_space=plgpu.SMEM)])

    def body(schedule_gmem, num_tiles_gmem, x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem):
        @_ws_scope(get_pipeline(_no_body, _no_body).get_allocations(
                       x_gmem.at[pl.ds(0, bm)], w_gmem.at[0, pl.ds(0, cta_n)], xs_gmem.at[:, pl.ds(0, bm)]),
                   plgpu.SMEM((wgs, bm, bn), out_dtype))
        def _scope(allocs, o_smem, wg):
            @_row_tiles(schedule_gmem, num_tiles_gmem, grid_n, grid_minor, 4)
            def _tile(mi, ni, group, row0):
                col_block = ni * wgs + wg  # this consumer's 128 columns: one weight scale per K step

                def store(values):
                    _write_tile(o_smem.at[wg], values)
                    _store_rows(o_smem.at[wg], o_gmem, row0, schedule_gmem[_START, mi],
                                schedule_gmem[_SIZE, mi], ladder, pl.ds(col_block * bn, bn), wait=False)

                def compute_context(run):
                    store(run(_acc_zeros(bm, bn)))

                def step(idx, x_smem, w_smem, s_smem, total):
                    part = _fp8_block_sum(x_smem, w_smem, (wg, bn))
                    rows = plgpu.load(s_smem, (0,), layout=plgpu.Layout.WGMMA.reduce(1))
                    return _promote(total, part, rows * ws_gmem[group, idx[0], col_block])

                @pl.when(group < g)
                def _():
                    get_pipeline(step, compute_context)(
                        x_gmem.at[_tile_rows(row0, bm)], w_gmem.at[group, pl.ds(ni * cta_n, cta_n)],
                        xs_gmem.at[:, _tile_rows(row0, bm)], allocations=allocs)

                @pl.when((group >= g) & (wg < wgs))  # rows past the groups: zeros, no matrix work
                def _():
                    store(jnp.zeros((bm, bn), jnp.float32))

    kernel = _ws_kernel(body, jax.ShapeDtypeStruct((m, n), out_dtype), num_sms)
    return kernel(schedule, num_tiles, xq, xs_t, wq_t, ws)


def transposed_ragged_dot_fp8(xt, xs, dyt, dys, info, *, stages: int = 4, minor: int = 0, width: int = 8,
                              out_dtype=jnp.bfloat16, ring: bool = False, num_sms: int | None = None):
    """The FP8 weight gradient: out[g] = sum over group g's 128-row blocks b of
    (xs[b, :, None] * dys[b, None, :]) * (xt[:, b] @ dyt[:, b].T), float32 sums, out_dtype [G, C, N].

    xt [C, P] and dyt [N, P] float8_e4m3fn: the rows token-minor (FP8 WGMMA takes both operands K-major,
    and K is the tokens here), each group's rows padded with zeros to whole 128-row blocks; xs [P/128, C]
    and dys [P/128, N] float32 one scale per block and channel (DeepSeek-V3's 128 x 1 tiles);
    info [4, G] gemm_fp8.row_blocks' per-group entry (first padded row, end, blocks, first row). A
    producer warpgroup loads while two consumers compute 64 x 128 each of a 64 x 256 output tile;
    each K step's block sum is promoted with the outer product of its row and column scales. ring: one
    ring of K-step buffers across the CTA's tiles (_k_ring), what tiles of 1-3 K steps need most."""
    c, p = xt.shape
    n, p2 = dyt.shape
    g = info.shape[1]
    wgs, bm, bn, bk = 2, 64, FP8_K_BLOCK, FP8_K_BLOCK
    cta_n = wgs * bn
    assert p == p2 and p % bk == 0 and c % bm == 0 and n % cta_n == 0, (xt.shape, dyt.shape)
    assert xs.shape == (p // bk, c) and dys.shape == (p // bk, n), (xs.shape, dys.shape)
    tf = _smem_transforms(xt.dtype, bk)
    out_tf = _smem_transforms(out_dtype, bn)
    grid_m, grid_n = c // bm, n // cta_n

    def promote(total, blocks, wg):
        part = _fp8_block_sum(blocks[0], blocks[1], (wg, bn))
        rows = plgpu.load(blocks[2], (0,), layout=plgpu.Layout.WGMMA.reduce(1))
        cols = plgpu.load(blocks[3], (0, pl.ds(wg * bn, bn)), layout=plgpu.Layout.WGMMA.reduce(0))
        return _promote(total, part * lax.broadcast_in_dim(cols, part.shape, (1,)), rows)

    def ring_body(info_gmem, xt_gmem, xs_gmem, dyt_gmem, dys_gmem, o_gmem):
        def load(t, kk, blocks, barrier):   # whole padded blocks: the padding rows are zeros
            ks, b = pl.ds(t.first_row + kk * bk, bk), pl.ds(t.first_row // bk + kk, 1)
            plgpu.copy_gmem_to_smem(xt_gmem.at[pl.ds(t.mi * bm, bm), ks], blocks[0], barrier)
            plgpu.copy_gmem_to_smem(dyt_gmem.at[pl.ds(t.ni * cta_n, cta_n), ks], blocks[1], barrier)
            plgpu.copy_gmem_to_smem(xs_gmem.at[b, pl.ds(t.mi * bm, bm)], blocks[2], barrier)
            plgpu.copy_gmem_to_smem(dys_gmem.at[b, pl.ds(t.ni * cta_n, cta_n)], blocks[3], barrier)

        def epilogue(t, total, wg, o_smem):
            _write_tile(o_smem.at[wg], total)
            cols = pl.ds(t.ni * cta_n + wg * bn, bn)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[t.gi, pl.ds(t.mi * bm, bm), cols])

        _k_ring(_group_ring_tiles(info_gmem, g, (grid_m, grid_n), minor, width, bk),
                [((bm, bk), xt.dtype, tf), ((cta_n, bk), dyt.dtype, tf), ((1, bm), xs.dtype, ()),
                 ((1, cta_n), dys.dtype, ())],
                load, lambda t, kk, blocks, total, wg: promote(total, blocks, wg), epilogue,
                stages=stages, wgs=wgs, delay=0, init_acc=lambda: _acc_zeros(bm, bn),
                scratch=plgpu.SMEM((wgs, bm, bn), out_dtype, transforms=out_tf))

    if ring:
        return _ws_kernel(ring_body, jax.ShapeDtypeStruct((g, c, n), out_dtype), num_sms)(
            info, xt, xs, dyt, dys)

    def get_pipeline(step, compute_context, num_k):
        return _ws_pipeline(
            step, compute_context, grid=(num_k,), wgs=wgs, stages=stages,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tf, memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((cta_n, bk), lambda kk: (0, kk), transforms=tf,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((1, bm), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((1, cta_n), lambda kk: (kk, 0), memory_space=plgpu.SMEM)])

    def body(info_gmem, xt_gmem, xs_gmem, dyt_gmem, dys_gmem, o_gmem):
        @_ws_scope(get_pipeline(_no_body, _no_body, stages).get_allocations(
                       xt_gmem.at[pl.ds(0, bm), pl.ds(0, p)], dyt_gmem.at[pl.ds(0, cta_n), pl.ds(0, p)],
                       xs_gmem.at[:, pl.ds(0, bm)], dys_gmem.at[:, pl.ds(0, cta_n)]),
                   plgpu.SMEM((wgs, bm, bn), out_dtype, transforms=out_tf))
        def _scope(allocs, o_smem, wg):
            @_group_tiles(info_gmem, g, (grid_m, grid_n), minor, width, bk)
            def _tile(gi, mi, ni, start, end, num_k, first_row):
                del start, end          # whole padded blocks: the padding rows are zeros
                out_cols = pl.ds(ni * cta_n + wg * bn, bn)

                def store(values):
                    _write_tile(o_smem.at[wg], values)
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[gi, pl.ds(mi * bm, bm), out_cols])

                def compute_context(run):
                    store(run(_acc_zeros(bm, bn)))

                def step(idx, x_smem, dy_smem, xs_smem, dys_smem, total):
                    return promote(total, (x_smem, dy_smem, xs_smem, dys_smem), wg)

                @pl.when(num_k > 0)
                def _():
                    blocks = pl.ds(first_row // bk, p // bk)
                    # the slices may run past the last block; the pipeline never reads past num_k of them
                    get_pipeline(step, compute_context, num_k)(
                        xt_gmem.at[pl.ds(mi * bm, bm), pl.ds(first_row, p)],
                        dyt_gmem.at[pl.ds(ni * cta_n, cta_n), pl.ds(first_row, p)],
                        xs_gmem.at[blocks, pl.ds(mi * bm, bm)], dys_gmem.at[blocks, pl.ds(ni * cta_n, cta_n)],
                        allocations=allocs)

                @pl.when((num_k == 0) & (wg < wgs))  # an empty group's gradient is zero
                def _():
                    store(jnp.zeros((bm, bn), jnp.float32))

    kernel = _ws_kernel(body, jax.ShapeDtypeStruct((g, c, n), out_dtype), num_sms)
    return kernel(info, xt, xs, dyt, dys)
