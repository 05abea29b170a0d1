// The paged attention's per-call bookkeeping, shared by cpu_attention.cpp and the decode stack.
//
// Which keys each query row sees, how its keys split into chunks and the work items over (row,
// KV head, chunk) depend on the batch (gather, lens, q_seq, q_row, mask) and the KV heads, not
// on the layer: the decode stack plans once a forward and runs every layer's attention from the
// plan (paged_attention from Python plans once a call).
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <vector>

struct AttentionPlan {
  struct Item { int64_t t, kvh, c; };
  int64_t T = 0, Hkv = 0, max_chunks = 1;
  std::vector<const int64_t*> row_slots;  // each row's visible keys' slots, in order
  std::vector<int64_t> row_len, visible, chunks, item_of;
  std::vector<Item> items;
  std::vector<float> states;  // the items' softmax states (scratch, reused by every layer)
  torch::Tensor gather;       // keeps the slots row_slots may point into
};

// Plan T query rows over Hkv KV heads (shapes as paged_attention's). The plan points into
// gather: it is held by the plan.
void plan_attention(AttentionPlan& p, const torch::Tensor& gather, const torch::Tensor& lens,
                    const torch::Tensor& q_seq, const torch::Tensor& q_row, const torch::Tensor& mask, int64_t T,
                    int64_t Hkv);

// One layer's attention from a plan: q [T, H, D] rows (contiguous), the layer's K and V caches
// [S, Hkv, D] (contiguous, q's dtype: float32 or bfloat16), out [T, H * D].
void attend_planned(AttentionPlan& p, at::ScalarType dtype, const void* q, const void* k_cache, const void* v_cache,
                    void* out, int64_t H, int64_t D, double scale);
