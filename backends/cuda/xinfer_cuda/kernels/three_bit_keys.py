"""Scores against uniform 3-bit keys read in eighths of the head dimension.

The 3-bit layout (``xinfer.kv.codes``) puts a row's codes in a low plane of D/4 bytes
(byte b holds dims b + (D/4) q at bits 2q) and a high plane of D/8 bytes (byte j holds
dims j + (D/8) k at bit k). Read by columns, each column's bits sit at shifts of its
own; read by eighths of E = D/8 dimensions, eighth e's codes are bits 2 (e // 2) of the
low plane's bytes [(e % 2) E, (e % 2 + 1) E) and bit e of the high plane's, so a row is
three loads of E contiguous bytes and every column of an eighth shares its shifts
(H200, one layer's decode at 1 x 32k: 52.5 -> 36.7 us against the columns' reading).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xinfer_cuda.kernels.kv_codes import DECODE_PTX, MAGIC_BITS


@triton.jit
def _quarters(x):
    """The four column quarters of ``x`` [M, C], in order, as [M, C/4] tiles."""
    M: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    y = tl.reshape(tl.permute(tl.reshape(x, [M, 4, C // 4]), [0, 2, 1]), [M, C // 4, 2, 2])
    even, odd = tl.split(y)  # quarters 0 and 2, quarters 1 and 3
    q0, q2 = tl.split(even)
    q1, q3 = tl.split(odd)
    return q0, q1, q2, q3


@triton.jit
def _eighth(low, high, LOW_SHIFT: tl.constexpr, HIGH_BIT: tl.constexpr, DTYPE: tl.constexpr):
    """3-bit codes of one eighth of the head dimension as numbers (as ``kv_codes._as_number``)."""
    code = (low.to(tl.int16) >> LOW_SHIFT) & 3 | ((high.to(tl.int16) >> HIGH_BIT) & 1) << 2
    if DTYPE == tl.float16:
        return (code | MAGIC_BITS).to(tl.float16, bitcast=True)
    return code.to(DTYPE)


def _eighths_ptx(first_high_bit: int) -> str:
    """PTX for fp16 numbers 1024 + code of four eighths of the head dimension from a
    word of four keys' low-plane bytes ($8) and one of their high-plane bytes ($9):
    eighth k takes bits 2k..2k+1 of $8 and bit ``first_high_bit`` + 2k of $9. Constant
    shifts put the high bit at bit 2, `lop3` merges it with the low bits, byte
    permutes set 0x64 above each code: about 5.5 instructions per four numbers."""
    lines = [".reg .b32 low, bit, c, magic;", "mov.b32 magic, 0x64;"]
    for k in range(4):
        if k:
            lines.append(f"shr.b32 low, $8, {2 * k};")
        shift = first_high_bit + 2 * k - 2
        if shift:
            op = "shl" if shift < 0 else "shr"
            lines += [f"{op}.b32 bit, $9, {abs(shift)};", "and.b32 bit, bit, 0x04040404;"]
        else:
            lines.append("and.b32 bit, $9, 0x04040404;")
        lines += [
            f"lop3.b32 c, {'low' if k else '$8'}, 0x03030303, bit, 0xea;",
            f"prmt.b32 ${2 * k}, c, magic, 0x4140;",
            f"prmt.b32 ${2 * k + 1}, c, magic, 0x4342;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


# Eighths 0, 2, 4, 6 come from the low plane's first E bytes, 1, 3, 5, 7 from its
# second E; eighth e's high bit is bit e of the high plane's byte.
_EVEN_EIGHTHS_PTX = tl.constexpr(_eighths_ptx(0))
_ODD_EIGHTHS_PTX = tl.constexpr(_eighths_ptx(1))


@triton.jit
def _eighths(low, high, PTX: tl.constexpr):
    """Four eighths' fp16 numbers from uint8 tiles of the low and high planes
    (:func:`_eighths_ptx`)."""
    return tl.inline_asm_elementwise(
        PTX,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
        [low, high],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def three_bit_scores(q_lo, q_hi, head_ptr, row, rows_ok, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
                      DECODE: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """q . k for the rows ``row`` of 3-bit codes read in eighths (module docstring):
    eight dots of depth E against the queries' eighths (``q_lo``, ``q_hi``: the halves
    of the head dimension)."""
    E: tl.constexpr = HEAD_DIM // 8
    at = head_ptr + row[:, None] + tl.arange(0, E)[None, :]
    ok = rows_ok[:, None]
    low_even = tl.load(at, mask=ok, other=0)
    low_odd = tl.load(at + E, mask=ok, other=0)
    high = tl.load(at + 2 * E, mask=ok, other=0)
    if DECODE >= DECODE_PTX and DTYPE == tl.float16:
        k0, k2, k4, k6 = _eighths(low_even, high, _EVEN_EIGHTHS_PTX)
        k1, k3, k5, k7 = _eighths(low_odd, high, _ODD_EIGHTHS_PTX)
    else:
        k0, k2 = _eighth(low_even, high, 0, 0, DTYPE), _eighth(low_even, high, 2, 2, DTYPE)
        k4, k6 = _eighth(low_even, high, 4, 4, DTYPE), _eighth(low_even, high, 6, 6, DTYPE)
        k1, k3 = _eighth(low_odd, high, 0, 1, DTYPE), _eighth(low_odd, high, 2, 3, DTYPE)
        k5, k7 = _eighth(low_odd, high, 4, 5, DTYPE), _eighth(low_odd, high, 6, 7, DTYPE)
    q0, q1, q2, q3 = _quarters(q_lo)
    q4, q5, q6, q7 = _quarters(q_hi)
    s = tl.dot(q0, tl.trans(k0), input_precision=PRECISION)
    s = tl.dot(q1, tl.trans(k1), s, input_precision=PRECISION)
    s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
    s = tl.dot(q3, tl.trans(k3), s, input_precision=PRECISION)
    s = tl.dot(q4, tl.trans(k4), s, input_precision=PRECISION)
    s = tl.dot(q5, tl.trans(k5), s, input_precision=PRECISION)
    s = tl.dot(q6, tl.trans(k6), s, input_precision=PRECISION)
    return tl.dot(q7, tl.trans(k7), s, input_precision=PRECISION)
