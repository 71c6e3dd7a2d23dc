"""Vector registers for the compiled kernels: a float32 vector type and five operations on it.

WHY. The compiler vectorises a loop whose innermost level is a reduction or an elementwise
pass. The kernel a few-row product needs is neither: it keeps a block of running sums in
registers across the whole reduction (rows of x times a panel of the weight), loads each
weight vector once for all rows, and broadcasts each x value against it, the way BLAS
microkernels are written. No loop nest states that to the compiler, so it is written here
with explicit vectors, each a value the compiler keeps in a register:

    vzero()              a vector of LANES zeros
    vsplat(s)            s (float32) in every lane
    vload(a, i)          a[i : i + LANES] of a 1-D float32 array (unaligned is fine)
    vstore(a, i, v)      a[i : i + LANES] = v
    vfma(a, b, c)        a · b + c per lane, one rounding (fused multiply-add)
    vadd(a, b)           a + b per lane
    vsum(v)              the sum of the lanes (pairwise: halves added, log2(LANES) steps)

LANES is the CPU's widest float32 vector: 16 with AVX-512, 8 with AVX2 or AVX, 4 otherwise
(SSE, NEON). Bounds are the caller's to respect: vload and vstore do not check them.
numba keys its disk cache on the CPU, so a kernel compiled for one width is never loaded on
a machine of another.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic, models, register_model


def _lanes() -> int:
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        return 16
    if features.get("avx2") or features.get("avx"):
        return 8
    return 4


LANES = _lanes()
_VECTOR = ir.VectorType(ir.FloatType(), LANES)


class Float32Vector(types.Type):
    """numba's type of a vector register of LANES float32s."""

    def __init__(self) -> None:
        super().__init__(name=f"float32x{LANES}")


float32xN = Float32Vector()


@register_model(Float32Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


def _address(context, builder, array_type, array, index):
    """A pointer to array[index] as a pointer to a vector."""
    array = context.make_array(array_type)(context, builder, array)
    pointer = cgutils.get_item_pointer(context, builder, array_type, array, [index],
                                       wraparound=False)
    return builder.bitcast(pointer, _VECTOR.as_pointer())


@intrinsic
def vload(typingctx, array, index):
    def codegen(context, builder, signature, args):
        return builder.load(_address(context, builder, signature.args[0], *args), align=4)
    return float32xN(array, index), codegen


@intrinsic
def vstore(typingctx, array, index, vector):
    def codegen(context, builder, signature, args):
        target = _address(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], target, align=4)
        return context.get_dummy_value()
    return types.void(array, index, vector), codegen


@intrinsic
def vsplat(typingctx, scalar):
    def codegen(context, builder, signature, args):
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), args[0],
                                     ir.Constant(ir.IntType(32), 0))
        lanes = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined), lanes)
    return float32xN(types.float32), codegen


@intrinsic
def vzero(typingctx):
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)
    return float32xN(), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    def codegen(context, builder, signature, args):
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), f"llvm.fma.v{LANES}f32")
        return builder.call(fma, args)
    return float32xN(float32xN, float32xN, float32xN), codegen


@intrinsic
def vsum(typingctx, vector):
    def codegen(context, builder, signature, args):
        v, width = args[0], LANES
        while width > 1:            # add the upper half onto the lower, until one lane
            width //= 2
            upper = ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                [width + i if i < width else i for i in range(LANES)])
            v = builder.fadd(v, builder.shuffle_vector(v, v, upper))
        return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))
    return types.float32(float32xN), codegen


@intrinsic
def vadd(typingctx, a, b):
    def codegen(context, builder, signature, args):
        return builder.fadd(*args)
    return float32xN(float32xN, float32xN), codegen
