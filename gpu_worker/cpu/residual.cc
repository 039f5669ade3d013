#include "gpu_worker/cpu/residual.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace hmoe::cpu {
namespace {

// ResidualKind::kPlain: one stream, x += sublayer(norm(x)).
class PlainResidual final : public Residual {
 public:
  explicit PlainResidual(int64_t H) : H_(H) {}
  void Begin(const float* x, int64_t T) override { x_.assign(x, x + T * H_); }
  const float* Input(int, Sublayer) override { return x_.data(); }
  void Join(int, Sublayer, const float* y) override {
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += y[i];
  }
  const float* Output() override { return x_.data(); }

 private:
  int64_t H_;
  std::vector<float> x_;
};

std::unique_ptr<Residual> MakePlain(int64_t H) { return std::make_unique<PlainResidual>(H); }

// The table: one implementation per ResidualKind.
struct ResidualRow {
  ResidualKind kind;
  std::unique_ptr<Residual> (*make)(int64_t H);
};
constexpr ResidualRow kResiduals[] = {
    {ResidualKind::kPlain, &MakePlain},
};

}  // namespace

absl::StatusOr<std::unique_ptr<Residual>> MakeResidual(const ResidualSpec& spec, int64_t H) {
  for (const ResidualRow& r : kResiduals)
    if (r.kind == spec.kind) return r.make(H);
  return absl::UnimplementedError(absl::StrCat(
      "cpu backend: residual kind ", ResidualKindName(spec.kind), " has no implementation"));
}

}  // namespace hmoe::cpu
