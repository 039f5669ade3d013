// The reference backend's DSA indexer alone: where it writes its keys and
// how it picks a query's keys (every key while there are at most
// index_topk; of equal scores, the earlier positions).
#include "gpu_worker/cpu/dsa_indexer.h"

#include <memory>
#include <numeric>
#include <vector>

#include "common/runtime/thread_pool.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe::cpu {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(DsaIndexer, EqualScoresKeepTheEarliestPositions) {
  // hidden 4, q LoRA 4, 2 heads of 4 (2 roped), top 2. wk = 0: every key is
  // the LayerNorm's bias, so every visible key scores the same.
  ModelConfig c;
  c.arch = Architecture::kDeepseekV32;
  c.hidden_size = 4;
  c.mla.q_lora_rank = 4;
  c.mla.qk_rope_head_dim = 2;
  c.dsa = {.n_heads = 2, .head_dim = 4, .topk = 2};
  const std::vector<float> wq(8 * 4, 0.5f), wk(4 * 4, 0.0f), norm_w(4, 1.0f),
      norm_b = {1.0f, 0.5f, -0.25f, 2.0f}, wproj(2 * 4, 0.25f);
  testing::TempDir dir;
  SafetensorsWriter w;
  const std::string x = "model.layers.0.self_attn.indexer.";
  ASSERT_TRUE(w.Add(x + "wq_b.weight", DType::kF32, {8, 4}, wq.data(), wq.size() * 4).ok());
  ASSERT_TRUE(w.Add(x + "wk.weight", DType::kF32, {4, 4}, wk.data(), wk.size() * 4).ok());
  ASSERT_TRUE(w.Add(x + "k_norm.weight", DType::kF32, {4}, norm_w.data(), 16).ok());
  ASSERT_TRUE(w.Add(x + "k_norm.bias", DType::kF32, {4}, norm_b.data(), 16).ok());
  ASSERT_TRUE(
      w.Add(x + "weights_proj.weight", DType::kF32, {2, 4}, wproj.data(), wproj.size() * 4).ok());
  ASSERT_TRUE(w.Write(dir.path() + "/model.safetensors").ok());
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  const int64_t offset = 3, row = offset + 4, T = 5;  // keys after 3 other floats
  DsaIndexer indexer(c, offset, row);
  ASSERT_TRUE(indexer.Load(**ckpt, NamesForLayer(c, 0), 0).ok());
  ThreadPoolOptions po;
  po.max_threads = 2;
  po.per_core = false;
  auto pool = ThreadPool::Create(po);
  ASSERT_TRUE(pool.ok()) << pool.status();

  std::vector<float> cache(static_cast<size_t>(T * row), -7.0f);
  std::vector<int64_t> pos(T);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> cs(static_cast<size_t>(T * 2));
  for (int64_t t = 0; t < T; ++t) cs[static_cast<size_t>(t * 2)] = 1.0f;  // rope: identity
  std::vector<float*> k(T, cache.data());
  const std::vector<float> h(T * 4, 1.0f), q_lora(T * 4, 1.0f);
  AttentionPass p{.pool = pool->get(),
                  .T = T,
                  .pos = pos.data(),
                  .max_pos = T - 1,
                  .rope_cs = cs.data(),
                  .k = k.data()};
  std::vector<std::vector<int64_t>> selected;
  indexer.Select(p, h.data(), q_lora.data(), &selected);
  ASSERT_EQ(selected.size(), static_cast<size_t>(T));
  EXPECT_THAT(selected[0], IsEmpty());  // 1 and 2 keys: all of them
  EXPECT_THAT(selected[1], IsEmpty());
  for (int64_t t = 2; t < T; ++t) EXPECT_THAT(selected[t], ElementsAre(0, 1)) << "position " << t;
  // Each key sits at the offset of its position's row; the rest is untouched.
  for (int64_t t = 0; t < T; ++t) {
    const float* r = cache.data() + t * row;
    EXPECT_THAT(std::vector<float>(r, r + offset), ElementsAre(-7.0f, -7.0f, -7.0f));
    EXPECT_THAT(std::vector<float>(r + offset, r + row), ElementsAre(1.0f, 0.5f, -0.25f, 2.0f));
  }
}

}  // namespace
}  // namespace hmoe::cpu
