#include "bench/accuracy.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/status.h"
#include "gpu_worker/server/local_experts.h"

namespace hmoe::accuracy {

std::vector<std::string> SplitDocs(const std::string& text) {
  std::vector<std::string> docs;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find("\n%\n", at);
    if (end == std::string::npos) end = text.size();
    std::string d = text.substr(at, end - at);
    if (d.find_first_not_of(" \t\r\n\f\v") != std::string::npos) docs.push_back(std::move(d));
    at = end + 3;
  }
  return docs;
}

absl::StatusOr<EvalSet> LoadEvalSet(const std::string& path, const Tokenizer& tok, int32_t bos,
                                    int32_t eos, int64_t max_docs) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::stringstream ss;
  ss << f.rdbuf();
  std::vector<std::string> docs = SplitDocs(ss.str());
  if (max_docs > 0 && static_cast<int64_t>(docs.size()) > max_docs)
    docs.resize(static_cast<size_t>(max_docs));
  if (docs.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no docs"));
  EvalSet set;
  for (size_t i = 0; i < docs.size(); ++i) {
    auto body = tok.Encode(docs[i]);
    if (!body.ok()) return Annotate(body.status(), absl::StrCat(path, ": doc ", i));
    std::vector<int32_t> ids = {bos};
    ids.insert(ids.end(), body->begin(), body->end());
    ids.push_back(eos);
    set.scored_tokens += static_cast<int64_t>(ids.size()) - 1;
    set.docs.push_back(std::move(ids));
  }
  return set;
}

absl::StatusOr<std::vector<float>> ScoreLogits(const Model& model, const EvalSet& set) {
  const int64_t V = model.config().vocab_size;
  std::vector<float> all;
  all.reserve(static_cast<size_t>(set.scored_tokens * V));
  for (size_t i = 0; i < set.docs.size(); ++i) {
    const std::vector<int32_t>& ids = set.docs[i];
    auto seq = model.NewSequence();
    auto logits =
        model.Prefill(*seq, absl::MakeConstSpan(ids).subspan(0, ids.size() - 1), LogitsMode::kAll);
    if (!logits.ok()) return Annotate(logits.status(), absl::StrCat("doc ", i));
    all.insert(all.end(), logits->begin(), logits->end());
  }
  return all;
}

namespace {

double LogSumExp(const float* row, int64_t V) {
  double mx = row[0];
  for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
  return mx + std::log(sum);
}

int64_t ArgMax(const float* row, int64_t V) { return std::max_element(row, row + V) - row; }

}  // namespace

absl::StatusOr<Metrics> Compare(const EvalSet& set, absl::Span<const float> exact,
                                absl::Span<const float> variant, int64_t vocab) {
  const size_t want = static_cast<size_t>(set.scored_tokens * vocab);
  if (vocab < 1 || exact.size() != want || variant.size() != want)
    return absl::InvalidArgumentError(absl::StrCat("logits: exact ", exact.size(), " and variant ",
                                                   variant.size(), " values, want ",
                                                   set.scored_tokens, " tokens x ", vocab));
  double nll_p = 0, nll_q = 0, kl = 0;
  int64_t agree = 0, i = 0;
  for (const std::vector<int32_t>& ids : set.docs) {
    for (size_t t = 0; t + 1 < ids.size(); ++t, ++i) {
      const float* p = exact.data() + i * vocab;
      const float* q = variant.data() + i * vocab;
      const double lse_p = LogSumExp(p, vocab), lse_q = LogSumExp(q, vocab);
      nll_p += lse_p - p[ids[t + 1]];
      nll_q += lse_q - q[ids[t + 1]];
      double k = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double lp = double(p[v]) - lse_p, lq = double(q[v]) - lse_q;
        k += std::exp(lp) * (lp - lq);
      }
      kl += k;
      agree += ArgMax(p, vocab) == ArgMax(q, vocab);
    }
  }
  Metrics m;
  m.tokens = set.scored_tokens;
  const double n = static_cast<double>(std::max<int64_t>(1, m.tokens));
  m.exact_ppl = std::exp(nll_p / n);
  m.ppl = std::exp(nll_q / n);
  m.ppl_change_pct = 100 * (m.ppl / m.exact_ppl - 1);
  m.mean_kl = kl / n;
  m.top1_agreement = static_cast<double>(agree) / n;
  return m;
}

std::vector<Variant> StandardVariants() {
  std::vector<Variant> v;
  for (int n = 0; n <= 3; ++n) {
    Variant d;
    d.name = absl::StrCat("deferral ", n);
    d.deferred_experts = n;
    if (n == 2) d.max_ppl_change_pct = 0.5;
    v.push_back(d);
  }
  auto service = [&](const std::string& name, WeightFormat f, int group,
                     std::optional<double> target) {
    Variant s;
    s.name = name;
    s.service_experts = true;
    s.format = f;
    s.group = group;
    s.max_ppl_change_pct = target;
    v.push_back(s);
  };
  service("bf16", WeightFormat::kBf16, 0, std::nullopt);
  service("int8", WeightFormat::kInt8, 0, 0.5);
  for (int g : {32, 64, 128}) service(absl::StrCat("int4 g", g), WeightFormat::kInt4, g, 3.0);
  for (auto [w, target] : {std::pair{DenseWeights::kFp8, 0.3}, std::pair{DenseWeights::kInt8, 0.3},
                           std::pair{DenseWeights::kInt4, 2.0}}) {
    Variant d;
    d.name = "dense " + std::string(DenseWeightsName(w));
    d.dense_weights = w;
    d.max_ppl_change_pct = target;
    v.push_back(d);
  }
  for (KvDtype kv : {KvDtype::kBf16, KvDtype::kFp8}) {
    Variant k;
    k.name = absl::StrCat("kv ", std::string(KvDtypeName(kv)));
    k.kv_dtype = kv;
    if (kv == KvDtype::kFp8) k.max_ppl_change_pct = 0.5;
    v.push_back(k);
  }
  return v;
}

absl::StatusOr<LoadedVariant> LoadVariant(const std::string& dir, const Variant& v, int threads) {
  LoadedVariant out;
  ModelOptions opt;
  opt.num_threads = threads;
  opt.deferred_experts = v.deferred_experts;
  opt.weights = v.dense_weights;
  opt.kv_dtype = v.kv_dtype;
  if (v.service_experts) {
    ShardOptions so;
    so.model_dir = dir;
    so.format = v.format;
    if (IsGrouped(v.format)) so.group = v.group;
    so.format_explicit = true;
    so.threads = threads;
    ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(dir));
    so.max_tokens = std::max<int64_t>(1, config.max_position_embeddings);
    ASSIGN_OR_RETURN(out.shard, ExpertShard::Load(so));
    ASSIGN_OR_RETURN(out.experts, HandlerRoutedExperts::Create(config, out.shard.get()));
  }
  ASSIGN_OR_RETURN(out.model, Model::Load(dir, opt, out.experts.get()));
  return out;
}

}  // namespace hmoe::accuracy
