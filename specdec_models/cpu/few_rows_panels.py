"""A numba kernel for `few_rows.FewRowsLinear` on weights packed into panels: out = x @ W.T for
fp32 calls of a few to 64 rows on an AVX2 CPU, at close to the host's arithmetic speed.

`few_rows_kernel` takes dot products along each weight row, four rows of x at a time. For one to
four rows that runs at the speed of reading the weights, but every four rows more take another pass
in which each step loads five vectors for four multiply-adds, and from 8 rows x no longer sits in
L1, so at 16 rows it takes more than twice what reading the weights or the arithmetic costs, and
oneDNN's packed product is no faster (docs/cpu.md; `specdec bench cpu --matmul-rows 16`).

Here the weight is packed once into panels of 16 output columns, (out / 16, in, 16): panel p, row
k holds W[16p : 16p + 16, k]. A tile of up to 6 rows of x by one panel keeps its 6 x 16 sums in
12 vector registers and walks k: each step loads the panel's 16 weights (two vectors), broadcasts
one element of each row of x, and makes 12 fused multiply-adds (the register blocking of BLAS
micro-kernels). So each weight is read from memory once per call and then from cache for every
further 6 rows, and a step's loads never outnumber its arithmetic. Numba's loop vectoriser does not
find this layout from Python loops (it vectorises along k instead), so the tile is written in LLVM
IR through `numba.extending.intrinsic` with 8-lane float vectors and `llvm.fma`, which LLVM lowers
to the host's instructions (ymm FMAs with AVX2). The panels are split between numba's threads; the
thread pool is `few_rows_kernel`'s (same sizing, same record of the count: `tell_threads`).

Rounding: each output is one sum per lane of k in order, by fused multiply-adds, so results differ
from `F.linear`'s in the last bits (about 1e-6 relative), as every few-row path's do. The packed
weights are a copy (as large as the weight; `few_rows` keeps them beside the layer, as it keeps
oneDNN's). Output columns past the weight's rows (when out is not a multiple of 16) are zero
weights, computed and dropped.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from torch import Tensor

from . import few_rows_kernel

PANEL = 16          # output columns per panel: two vectors of 8 fp32 lanes
LANES = 8
TILE_ROWS = 6       # rows of x per tile (t6 below): 6 x 2 sums, 2 weight vectors and a broadcast in 16 registers


def pack(weight: np.ndarray | Tensor) -> np.ndarray:
    """An fp32 (out, in) weight packed into (ceil(out / 16), in, 16) panels, zero-padded."""
    w = weight.detach().float().contiguous().numpy() if isinstance(weight, Tensor) else np.asarray(weight, np.float32)
    out, k = w.shape
    panels = -(-out // PANEL)
    if panels * PANEL != out:
        w = np.concatenate([w, np.zeros((panels * PANEL - out, k), np.float32)])
    return np.ascontiguousarray(w.reshape(panels, PANEL, k).transpose(0, 2, 1))


def _tile(rows: int):
    """An intrinsic tile(wp, x, out, p, r0): out[r0 : r0 + rows, 16p : 16p + 16] = x[r0 : r0 + rows] @
    panel p, for C-contiguous fp32 arrays wp (panels, in, 16), x (n, in) and out (n, panels * 16),
    in >= 1 (the caller checks)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    f32 = ir.FloatType()
    i64 = ir.IntType(64)
    vec = ir.VectorType(f32, LANES)

    def const(n: int) -> ir.Constant:
        return ir.Constant(i64, n)

    @intrinsic
    def tile(typingctx, wp, x, out, p, r0):
        arrays = (wp, x, out)
        if not (all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in arrays)
                and (wp.ndim, x.ndim, out.ndim) == (3, 2, 2)
                and isinstance(p, types.Integer) and isinstance(r0, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            wpa, xa, oa = (context.make_array(t)(context, builder, a)
                           for t, a in zip(signature.args[:3], args[:3], strict=True))
            p_ = context.cast(builder, args[3], signature.args[3], types.int64)
            r0_ = context.cast(builder, args[4], signature.args[4], types.int64)
            k_in = builder.extract_value(wpa.shape, 1)
            x_cols = builder.extract_value(xa.shape, 1)
            out_cols = builder.extract_value(oa.shape, 1)
            panel = builder.gep(wpa.data, [builder.mul(p_, builder.mul(k_in, const(PANEL)))])
            x_rows = [builder.gep(xa.data, [builder.mul(builder.add(r0_, const(r)), x_cols)]) for r in range(rows)]
            module = builder.module
            fma = module.globals.get("llvm.fma.v8f32") or ir.Function(
                module, ir.FunctionType(vec, [vec, vec, vec]), name="llvm.fma.v8f32")
            before = builder.block
            loop = builder.function.append_basic_block("panel_tile_loop")
            after = builder.function.append_basic_block("panel_tile_after")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(const(0), before)
            sums = []
            for _ in range(2 * rows):
                s = builder.phi(vec)
                s.add_incoming(ir.Constant(vec, [0.0] * LANES), before)
                sums.append(s)
            at = builder.gep(panel, [builder.mul(k, const(PANEL))])
            w = [builder.load(builder.bitcast(builder.gep(at, [const(LANES * h)]), vec.as_pointer()), align=4)
                 for h in range(2)]
            undef = ir.Constant(vec, ir.Undefined)
            splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
            new = []
            for r in range(rows):
                xs = builder.load(builder.gep(x_rows[r], [k]), align=4)
                xv = builder.shuffle_vector(builder.insert_element(undef, xs, ir.Constant(ir.IntType(32), 0)),
                                            undef, splat)
                new += [builder.call(fma, [xv, w[h], sums[2 * r + h]]) for h in range(2)]
            k_next = builder.add(k, const(1))
            k.add_incoming(k_next, loop)
            for s, v in zip(sums, new, strict=True):
                s.add_incoming(v, loop)
            builder.cbranch(builder.icmp_signed("<", k_next, k_in), loop, after)
            builder.position_at_end(after)
            column = builder.mul(p_, const(PANEL))
            for r in range(rows):
                row = builder.gep(oa.data, [builder.add(builder.mul(builder.add(r0_, const(r)), out_cols), column)])
                for h in range(2):
                    builder.store(new[2 * r + h], builder.bitcast(builder.gep(row, [const(LANES * h)]),
                                                                  vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(wp, x, out, p, r0), codegen

    return tile


@cache
def _compiled():
    """The kernel, compiled on first use (about 2 s; numba cannot cache intrinsics made at run time):
    `few_rows` calls this when it packs layers, so that no decoding call pays for it."""
    few_rows_kernel._pool_size()
    import numba

    t1, t2, t3, t4, t5, t6 = (_tile(r) for r in range(1, TILE_ROWS + 1))

    @numba.njit(parallel=True, nogil=True)
    def panels_wt(wp, x):                  # pragma: no cover - compiled; checked against F.linear in the tests
        panels = wp.shape[0]
        rows = x.shape[0]
        out = np.empty((rows, panels * PANEL), np.float32)
        for p in numba.prange(panels):
            r = 0
            while r + TILE_ROWS <= rows:
                t6(wp, x, out, p, r)
                r += TILE_ROWS
            left = rows - r
            if left == 5:
                t5(wp, x, out, p, r)
            elif left == 4:
                t4(wp, x, out, p, r)
            elif left == 3:
                t3(wp, x, out, p, r)
            elif left == 2:
                t2(wp, x, out, p, r)
            elif left == 1:
                t1(wp, x, out, p, r)
        return out

    panels_wt(np.zeros((1, 1, PANEL), np.float32), np.zeros((1, 1), np.float32))   # compiled now, for these types
    return numba, panels_wt


def compile_kernel() -> None:
    """Compile the kernel now (once per process), where a caller would rather not pay for it in its
    first product."""
    _compiled()


def matmul_panels(x: Tensor, panels: np.ndarray, out_features: int, shape: tuple[int, ...] | None = None) -> Tensor:
    """x @ W.T for x (rows, in) fp32 on the CPU and W packed by `pack` into `panels`: a new (rows,
    out_features) tensor, or of `shape` (rows x out_features in all). The caller checks dtype,
    device, that no gradient is wanted and that in >= 1 (`few_rows`)."""
    numba, panels_wt = _compiled()
    few_rows_kernel.tell_threads(numba)
    out = panels_wt(panels, x.contiguous().numpy())
    if out.shape[1] != out_features:
        out = np.ascontiguousarray(out[:, :out_features])
    return torch.from_numpy(out if shape is None else out.reshape(shape))
