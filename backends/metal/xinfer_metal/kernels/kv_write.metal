// Storing a step's K and V into the paged cache [num_blocks, block_size, Hkv, ...] at
// slot_mapping[t] = block * block_size + offset (negative: padding, skipped).

// The model dtype as it is: rows copied in 2-byte units (every float dtype's rows are a
// whole number of them). Grid (row_units, T).
kernel void write_kv(
    device const ushort* k,             // [T, Hkv * D] of the cache's dtype, in 2-byte units
    device const ushort* v,
    device ushort* k_cache,             // [num_slots, Hkv * D], likewise
    device ushort* v_cache,
    device const long* slot_mapping,    // [T]
    constant long& row_units,           // 2-byte units of one token's Hkv * D values
    uint2 position [[thread_position_in_grid]]) {
    long slot = slot_mapping[position.y];
    if (slot < 0 || long(position.x) >= row_units) {
        return;
    }
    long from = long(position.y) * row_units + position.x, to = slot * row_units + position.x;
    k_cache[to] = k[from];
    v_cache[to] = v[from];
}

// One side quantized: each simdgroup encodes one (token, KV head) row of x, already in the
// basis the format stores (offset, equalized, rotated), with its absmax as the scale.
// Grid (32 * Hkv, T), threadgroups of 32.
kernel void quant_write_kv(
    device const float* x,              // [T, Hkv, D] in the stored basis
    device uchar* cache,                // [num_slots * Hkv, row_bytes]
    device float* scales,               // [num_slots * Hkv]
    device const long* slot_mapping,    // [T]
    constant long& num_kv_heads,
    constant long& head_dim,
    constant long& codec,               // FP8, UNIFORM8 or UNIFORM4
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
    long slot = slot_mapping[group.y];
    if (slot < 0) {
        return;
    }
    uint half_dim = uint(head_dim / 2);
    long source = long(group.y) * num_kv_heads + group.x, row = slot * num_kv_heads + group.x;
    device const float* values = x + source * head_dim;
    float largest = 0.0f;
    for (uint j = lane; j < half_dim; j += 32) {
        largest = max(largest, max(fabs(values[j]), fabs(values[half_dim + j])));
    }
    float scale = max(simd_max(largest), 1e-12f);  // xinfer.kv.codes.TINY keeps a zero row's scale nonzero
    device uchar* out = cache + row * row_bytes(codec, head_dim);
    if (lane == 0) {
        scales[row] = scale;
    }
    if (codec == FP8) {
        float step = scale / FP8_MAX;
        for (uint j = lane; j < uint(head_dim); j += 32) {
            out[j] = uchar(float_to_e4m3(clamp(values[j] / step, -FP8_MAX, FP8_MAX)));
        }
        return;
    }
    float half_levels = uniform_half(codec);
    float top = 2.0f * half_levels;
    for (uint j = lane; j < half_dim; j += 32) {
        float2 pair = float2(values[j], values[half_dim + j]);
        float2 codes = clamp(rint(pair / scale * half_levels + half_levels), float2(0.0f), float2(top));
        if (codec == UNIFORM4) {
            out[j] = uchar(uint(codes.x) | (uint(codes.y) << 4));
        } else {
            out[j] = uchar(codes.x);
            out[half_dim + j] = uchar(codes.y);
        }
    }
}
