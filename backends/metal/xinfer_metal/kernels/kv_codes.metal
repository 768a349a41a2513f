// How one side (K or V) of a cache row is stored, as xinfer.kv.codecs stores it: the
// codec ids below are xinfer_metal.kernels.codecs.Codec's (CI compares the two).
//
// A row is one (token, KV head) vector of D values. Every reader here takes the pair of
// elements (j, D/2 + j): a 4-bit row keeps exactly that pair in byte j (low nibble, high
// nibble), so one byte read gives both and no bits cross a byte.
#include <metal_stdlib>
using namespace metal;

constant constexpr long PLAIN_F32 = 0;  // the model dtype, unquantized
constant constexpr long PLAIN_F16 = 1;
constant constexpr long PLAIN_BF16 = 2;
constant constexpr long FP8 = 3;        // e4m3 bytes, scale = absmax (x = e4m3 * scale / 448)
constant constexpr long UNIFORM8 = 4;   // 255 levels over [-absmax, absmax], one per byte
constant constexpr long UNIFORM4 = 5;   // 16 levels over [-absmax, absmax], two per byte

constant constexpr float FP8_MAX = 448.0f;

// bytes of one row of D values
inline long row_bytes(long codec, long dim) {
    switch (codec) {
    case PLAIN_F32: return 4 * dim;
    case PLAIN_F16:
    case PLAIN_BF16: return 2 * dim;
    case UNIFORM4: return dim / 2;
    default: return dim;  // FP8, UNIFORM8
    }
}

// half-way between codes: the midpoint of n levels is (n - 1) / 2
inline float uniform_half(long codec) { return codec == UNIFORM8 ? 127.0f : 7.5f; }

inline float bf16_to_float(ushort bits) { return as_type<float>(uint(bits) << 16); }

inline float e4m3_to_float(uint bits) {
    uint exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
    float magnitude = exponent == 0 ? float(mantissa) * 0x1p-9f
                                    : ldexp(1.0f + float(mantissa) * 0.125f, int(exponent) - 7);
    return (bits & 0x80) ? -magnitude : magnitude;
}

// |x| <= 448 to e4m3fn bits, rounding to nearest even as torch's float8_e4m3fn cast does
inline uint float_to_e4m3(float x) {
    uint sign = signbit(x) ? 0x80 : 0;
    float a = fabs(x);
    if (a < 0x1p-6f) {  // subnormals are multiples of 2^-9; 8 of them is the smallest normal, bits 0x08
        return sign | uint(rint(a * 512.0f));
    }
    int exponent;
    float fraction = frexp(a, exponent);  // a = fraction * 2^exponent, fraction in [0.5, 1)
    uint mantissa = uint(rint((fraction * 2.0f - 1.0f) * 8.0f));
    if (mantissa == 8) {  // rounded up to the next power of two
        mantissa = 0;
        exponent += 1;
    }
    return sign | (uint(exponent - 1 + 7) << 3) | mantissa;
}

// elements j and half_dim + j of row `row` (slot * Hkv + head) of a cache side, in fp32
inline float2 load_pair(device const uchar* cache, device const float* scales, long codec, long row, uint j,
                        uint half_dim) {
    long dim = 2 * long(half_dim);
    device const uchar* base = cache + row * row_bytes(codec, dim);
    switch (codec) {
    case PLAIN_F32: {
        device const float* x = (device const float*)base;
        return float2(x[j], x[half_dim + j]);
    }
    case PLAIN_F16: {
        device const half* x = (device const half*)base;
        return float2(float(x[j]), float(x[half_dim + j]));
    }
    case PLAIN_BF16: {
        device const ushort* x = (device const ushort*)base;
        return float2(bf16_to_float(x[j]), bf16_to_float(x[half_dim + j]));
    }
    case FP8:
        return float2(e4m3_to_float(base[j]), e4m3_to_float(base[half_dim + j])) * (scales[row] / FP8_MAX);
    case UNIFORM8:
        return (float2(base[j], base[half_dim + j]) - 127.0f) * (scales[row] / 127.0f);
    default: {  // UNIFORM4
        uint both = base[j];
        return (float2(both & 0xF, both >> 4) - 7.5f) * (scales[row] / 7.5f);
    }
    }
}
