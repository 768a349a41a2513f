// Causal paged attention over the block table, reading each cache side in its format in
// place (xinfer.ops.Ops.attention; with key limits, a query sees keys up to its limit): the
// query is already in the keys' basis and scaled (rotated formats), and the output stays in
// the values' basis (the caller rotates back).
//
// One threadgroup per (query head, query token), of `num_simdgroups` simdgroups of 32
// threads. Each simdgroup walks every num_simdgroups-th visible key with its own online
// softmax, each lane holding the element pairs (j, D/2 + j) for j = lane, lane + 32, ...;
// the simdgroups' partial sums are then merged in threadgroup memory. Decode (one query
// per sequence) launches 8 simdgroups, so that a long context is split over them; prefill
// launches 1 per query token, whose rows already fill the GPU (each walks its keys alone:
// no tile of queries shares a key load yet).

constant constexpr uint MAX_PAIRS = 4;        // head_dim <= 2 * 32 * MAX_PAIRS = 256
constant constexpr uint MAX_SIMDGROUPS = 8;
constant constexpr uint MAX_HEAD_DIM = 256;
constant constexpr float NO_SCORE = -1e30f;  // the running max before any key (no infinities: fast math may drop them)

kernel void paged_attention(
    device const float* q,              // [T, H, D] in the keys' basis
    device const uchar* k_cache,        // [num_slots * Hkv, row bytes] in k_codec
    device const float* k_scale,        // [num_slots * Hkv] (unread by plain codecs)
    device const uchar* v_cache,
    device const float* v_scale,
    device const int* block_tables,     // [B, max_blocks]
    device const int* seq_lens,         // [B], this step's tokens included
    device const int* cu_seqlens_q,     // [B + 1]
    device const int* key_limits,       // [T] or unread: with has_key_limits, query t sees keys up to key_limits[t]
    device float* out,                  // [T, H, D] in the values' basis
    constant long& num_seqs,
    constant long& num_heads,
    constant long& num_kv_heads,
    constant long& head_dim,
    constant long& block_size,
    constant long& max_blocks,
    constant long& k_codec,
    constant long& v_codec,
    constant float& scale,
    constant long& window,              // 0: none; else a query at p sees keys p - window < j <= p
    constant float& softcap,            // 0: none; else scores become softcap * tanh(scores / softcap)
    constant long& has_key_limits,      // 0: each query sees keys up to its own position (causal)
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint num_simdgroups [[simdgroups_per_threadgroup]]) {
    threadgroup float group_max[MAX_SIMDGROUPS];
    threadgroup float group_sum[MAX_SIMDGROUPS];
    threadgroup float group_out[MAX_SIMDGROUPS][MAX_HEAD_DIM];

    long head = group.x, token = group.y;
    if (token >= cu_seqlens_q[num_seqs]) {  // beyond the batch's queries
        return;
    }
    long seq = 0, last = num_seqs - 1;  // the last sequence whose queries start at or before the token
    while (seq < last) {
        long mid = (seq + last + 1) / 2;
        if (cu_seqlens_q[mid] <= token) {
            seq = mid;
        } else {
            last = mid - 1;
        }
    }
    long context = seq_lens[seq];
    long position = context - (cu_seqlens_q[seq + 1] - token);  // the query's position in its sequence
    long first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
    long last_key = has_key_limits ? long(key_limits[token]) : position;  // (an image's tokens see each other)
    long kv_head = head / (num_heads / num_kv_heads);
    uint half_dim = uint(head_dim / 2);
    device const int* table = block_tables + seq * max_blocks;

    float2 query[MAX_PAIRS], acc[MAX_PAIRS];
    device const float* q_row = q + (token * num_heads + head) * head_dim;
    for (uint p = 0; p < MAX_PAIRS; ++p) {
        uint j = lane + 32 * p;
        query[p] = j < half_dim ? float2(q_row[j], q_row[half_dim + j]) * scale : float2(0.0f);
        acc[p] = float2(0.0f);
    }
    float running_max = NO_SCORE, running_sum = 0.0f;
    uint keys_per_block = uint(block_size);  // 32-bit: a 64-bit division per key is slow on the GPU
    for (uint key = uint(first) + simdgroup; key <= uint(last_key); key += num_simdgroups) {
        long slot = long(table[key / keys_per_block]) * block_size + key % keys_per_block;
        long row = slot * num_kv_heads + kv_head;
        float partial = 0.0f;
        for (uint p = 0; p < MAX_PAIRS; ++p) {
            uint j = lane + 32 * p;
            if (j < half_dim) {
                partial += dot(query[p], load_pair(k_cache, k_scale, k_codec, row, j, half_dim));
            }
        }
        float score = simd_sum(partial);
        if (softcap > 0.0f) {
            score = softcap * precise::tanh(score / softcap);
        }
        float new_max = max(running_max, score);
        float correction = exp(running_max - new_max), weight = exp(score - new_max);
        running_sum = running_sum * correction + weight;
        for (uint p = 0; p < MAX_PAIRS; ++p) {
            uint j = lane + 32 * p;
            if (j < half_dim) {
                acc[p] = acc[p] * correction + weight * load_pair(v_cache, v_scale, v_codec, row, j, half_dim);
            }
        }
        running_max = new_max;
    }

    if (lane == 0) {
        group_max[simdgroup] = running_max;
        group_sum[simdgroup] = running_sum;
    }
    for (uint p = 0; p < MAX_PAIRS; ++p) {
        uint j = lane + 32 * p;
        if (j < half_dim) {
            group_out[simdgroup][j] = acc[p].x;
            group_out[simdgroup][half_dim + j] = acc[p].y;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (simdgroup != 0) {
        return;
    }
    float overall_max = NO_SCORE;
    for (uint g = 0; g < num_simdgroups; ++g) {
        overall_max = max(overall_max, group_max[g]);
    }
    float total = 0.0f;
    float2 merged[MAX_PAIRS];
    for (uint p = 0; p < MAX_PAIRS; ++p) {
        merged[p] = float2(0.0f);
    }
    for (uint g = 0; g < num_simdgroups; ++g) {
        // a simdgroup that saw no key holds NO_SCORE and sums 0: it adds nothing
        float weight = group_max[g] == NO_SCORE ? 0.0f : exp(group_max[g] - overall_max);
        total += group_sum[g] * weight;
        for (uint p = 0; p < MAX_PAIRS; ++p) {
            uint j = lane + 32 * p;
            if (j < half_dim) {
                merged[p] += weight * float2(group_out[g][j], group_out[g][half_dim + j]);
            }
        }
    }
    device float* out_row = out + (token * num_heads + head) * head_dim;
    for (uint p = 0; p < MAX_PAIRS; ++p) {
        uint j = lane + 32 * p;
        if (j < half_dim) {
            out_row[j] = merged[p].x / total;
            out_row[half_dim + j] = merged[p].y / total;
        }
    }
}
