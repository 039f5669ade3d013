// Packing quantized experts (common/experts/quantize.h) into the layout
// documented in packed.h, and back.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "expert_service/kernels/moe.h"

namespace hmoe {

int64_t KAlign(WeightFormat f, int group) {
  if (IsNativeFormat(f)) return NativeSuperBlockK(f, group);
  return IsGrouped(f) ? std::max<int64_t>(64, group) : 64;
}

PackedGeom MakeGeom(WeightFormat f, int group, int64_t n, int64_t k) {
  PackedGeom g;
  g.format = f;
  g.group = IsGrouped(f) ? group : 0;
  g.n = n;
  g.k = k;
  g.np = RoundUp(n, 16);
  g.kp = RoundUp(std::max<int64_t>(k, 1), KAlign(f, group));
  g.nblocks = g.np / 16;
  switch (f) {
    case WeightFormat::kBf16:
      g.panel_bytes = g.kp * 32;
      break;
    case WeightFormat::kInt8:
      g.panel_bytes = g.kp * 16 + 128;
      break;
    case WeightFormat::kInt4:
      g.panel_bytes = g.kp / group * g.i4_group_bytes();
      break;
    case WeightFormat::kMxfp4:
    case WeightFormat::kInt4Bf16:
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8: {
      g.sb_k = NativeSuperBlockK(f, group);
      g.sb_code_bytes = g.sb_k * 16 * Traits(f).bits / 8;
      const int64_t scales = f == WeightFormat::kFp8 ? 0 : g.sb_k / group * 16 * ScaleBytes(f);
      g.sb_bytes = g.sb_code_bytes + scales;
      g.nsb = g.kp / g.sb_k;
      g.fp8_scale_offset = g.nsb * g.sb_bytes;
      g.panel_bytes = g.fp8_scale_offset;
      if (f == WeightFormat::kFp8) g.panel_bytes += RoundUp(g.nsb * 4, 64);
      break;
    }
  }
  return g;
}

namespace {

// ---- panel writers ---------------------------------------------------------------
// Src provides, for panel-local row c (0..15) and panel-local k (0..kp):
//   bf16(c, k) -> uint16_t, q(c, k) -> int, scale(c) (int8), gscale(c, gi) (int4)
// and must return 0 for padding.
// Native formats: Src also provides code(c, k) -> uint8_t (the raw 4- or
// 8-bit code), e8m0(c, gi) and bf16s(c, gi) (the scale of panel-local group
// gi), and f32s(sb) (fp8: super-block sb's scale).
template <typename Src>
void WriteNativePanel(const PackedGeom& g, const Src& s, uint8_t* dst) {
  const bool four = Traits(g.format).bits == 4;
  const int64_t groups = g.sb_k / g.group;
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    uint8_t* p = dst + sb * g.sb_bytes;
    const int64_t kb = sb * g.sb_k;
    if (four) {
      for (int64_t o = 0; o < g.sb_k / 8; ++o)
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 4; ++i)
            p[o * 64 + 4 * c + i] = static_cast<uint8_t>((s.code(c, kb + 8 * o + i) & 15) |
                                                         (s.code(c, kb + 8 * o + 4 + i) << 4));
    } else {
      for (int64_t o = 0; o < g.sb_k / 4; ++o)
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 16; ++c) p[o * 64 + 16 * i + c] = s.code(c, kb + 4 * o + i);
    }
    uint8_t* sc = p + g.sb_code_bytes;
    for (int64_t gi = 0; gi < groups && g.format != WeightFormat::kFp8; ++gi)
      for (int c = 0; c < 16; ++c) {
        if (g.format == WeightFormat::kInt4Bf16) {
          const uint16_t v = s.bf16s(c, sb * groups + gi);
          std::memcpy(sc + (gi * 16 + c) * 2, &v, 2);
        } else {
          sc[gi * 16 + c] = s.e8m0(c, sb * groups + gi);
        }
      }
  }
  if (g.format == WeightFormat::kFp8) {
    uint8_t* t = dst + g.fp8_scale_offset;
    std::memset(t, 0, static_cast<size_t>(g.panel_bytes - g.fp8_scale_offset));
    for (int64_t sb = 0; sb < g.nsb; ++sb) {
      const float v = s.f32s(sb);
      std::memcpy(t + sb * 4, &v, 4);
    }
  }
}

template <typename Src>
void WritePanel(const PackedGeom& g, const Src& s, uint8_t* dst) {
  switch (g.format) {
    case WeightFormat::kBf16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(dst);
      for (int64_t kk = 0; kk < g.kp / 2; ++kk)
        for (int c = 0; c < 16; ++c) {
          p[kk * 32 + 2 * c] = s.bf16(c, 2 * kk);
          p[kk * 32 + 2 * c + 1] = s.bf16(c, 2 * kk + 1);
        }
      break;
    }
    case WeightFormat::kInt8: {
      int8_t* p = reinterpret_cast<int8_t*>(dst);
      int32_t rowsum[16] = {};
      for (int64_t q = 0; q < g.kp / 4; ++q)
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 4; ++i) {
            const int v = s.q(c, 4 * q + i);
            p[q * 64 + 4 * c + i] = static_cast<int8_t>(v);
            rowsum[c] += v;
          }
      float* sc = reinterpret_cast<float*>(dst + g.i8_scale_offset());
      for (int c = 0; c < 16; ++c) sc[c] = s.scale(c);
      std::memcpy(dst + g.i8_rowsum_offset(), rowsum, sizeof(rowsum));
      break;
    }
    case WeightFormat::kInt4: {
      const int64_t groups = g.kp / g.group;
      for (int64_t gi = 0; gi < groups; ++gi) {
        uint8_t* gp = dst + gi * g.i4_group_bytes();
        for (int64_t o = 0; o < g.group / 8; ++o) {
          const int64_t k0 = gi * g.group + 8 * o;
          for (int c = 0; c < 16; ++c)
            for (int i = 0; i < 4; ++i) {
              const int lo = s.q(c, k0 + i) + 8, hi = s.q(c, k0 + 4 + i) + 8;
              gp[o * 64 + 4 * c + i] = static_cast<uint8_t>(lo | (hi << 4));
            }
        }
        float* sc = reinterpret_cast<float*>(gp + int64_t{g.group} * 8);
        for (int c = 0; c < 16; ++c) sc[c] = s.gscale(c, gi);
      }
      break;
    }
    case WeightFormat::kMxfp4:
    case WeightFormat::kInt4Bf16:
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8:
      WriteNativePanel(g, s, dst);
      break;
  }
}

// Reads panel-local (c, k) back.
struct PanelReader {
  const PackedGeom& g;
  const uint8_t* p;
  uint16_t bf16(int c, int64_t k) const {
    return reinterpret_cast<const uint16_t*>(p)[(k / 2) * 32 + 2 * c + (k & 1)];
  }
  int q(int c, int64_t k) const {
    if (g.format == WeightFormat::kInt8)
      return reinterpret_cast<const int8_t*>(p)[(k / 4) * 64 + 4 * c + (k & 3)];
    const int64_t gi = k / g.group, kin = k % g.group;
    const uint8_t b = p[gi * g.i4_group_bytes() + (kin / 8) * 64 + 4 * c + (kin & 3)];
    return ((kin & 4) ? (b >> 4) : (b & 15)) - 8;
  }
  float scale(int c) const { return reinterpret_cast<const float*>(p + g.i8_scale_offset())[c]; }
  float gscale(int c, int64_t gi) const {
    return reinterpret_cast<const float*>(p + gi * g.i4_group_bytes() + int64_t{g.group} * 8)[c];
  }
  // Native formats.
  uint8_t code(int c, int64_t k) const {
    const uint8_t* sb = p + (k / g.sb_k) * g.sb_bytes;
    const int64_t kk = k % g.sb_k;
    if (Traits(g.format).bits == 8) return sb[(kk / 4) * 64 + 16 * (kk % 4) + c];
    const uint8_t b = sb[(kk / 8) * 64 + 4 * c + (kk & 3)];
    return static_cast<uint8_t>((kk & 4) ? b >> 4 : b & 15);
  }
  const uint8_t* scale_at(int c, int64_t gi) const {
    const int64_t per = g.sb_k / g.group;
    return p + (gi / per) * g.sb_bytes + g.sb_code_bytes +
           ((gi % per) * 16 + c) * ScaleBytes(g.format);
  }
  uint8_t e8m0(int c, int64_t gi) const { return *scale_at(c, gi); }
  uint16_t bf16s(int c, int64_t gi) const {
    uint16_t v;
    std::memcpy(&v, scale_at(c, gi), 2);
    return v;
  }
  float f32s(int64_t sb) const {
    float v;
    std::memcpy(&v, p + g.fp8_scale_offset + sb * 4, 4);
    return v;
  }
};

// A window of a QuantMatrix: rows [r0, r0 + 16) ∩ [0, rend), cols c0 + k for k < kn.
struct MatrixWindow {
  const QuantMatrix& m;
  int64_t r0, rend, c0, kn;
  bool in(int c, int64_t k) const { return r0 + c < rend && k < kn; }
  size_t idx(int c, int64_t k) const { return static_cast<size_t>((r0 + c) * m.cols + c0 + k); }
  uint16_t bf16(int c, int64_t k) const { return in(c, k) ? m.bf16[idx(c, k)] : 0; }
  int q(int c, int64_t k) const { return in(c, k) ? m.q[idx(c, k)] : 0; }
  float scale(int c) const { return r0 + c < rend ? m.scale[static_cast<size_t>(r0 + c)] : 0.0f; }
  float gscale(int c, int64_t gi) const {
    const int64_t ng = (m.cols + m.group - 1) / m.group;
    const int64_t gg = c0 / m.group + gi;
    if (r0 + c >= rend || gi * m.group >= kn) return 0.0f;
    return m.scale[static_cast<size_t>((r0 + c) * ng + gg)];
  }
  // Native formats.
  uint8_t code(int c, int64_t k) const {
    if (!in(c, k)) return 0;
    const int64_t r = r0 + c, col = c0 + k, rb = RowBytes(m.format, m.cols);
    if (Traits(m.format).bits == 8) return m.packed[static_cast<size_t>(r * rb + col)];
    const uint8_t b = m.packed[static_cast<size_t>(r * rb + col / 2)];
    return static_cast<uint8_t>((col & 1) ? b >> 4 : b & 15);
  }
  // The scale index of panel-local group gi of row c (-1: padding).
  int64_t sidx(int c, int64_t gi) const {
    if (r0 + c >= rend || gi * m.group >= kn) return -1;
    return ScaleIndex(m.format, m.group, m.cols, r0 + c, c0 + gi * m.group);
  }
  uint8_t e8m0(int c, int64_t gi) const {
    const int64_t i = sidx(c, gi);
    return i < 0 ? 0 : m.scale_e8m0[static_cast<size_t>(i)];
  }
  uint16_t bf16s(int c, int64_t gi) const {
    const int64_t i = sidx(c, gi);
    return i < 0 ? 0 : m.scale_bf16[static_cast<size_t>(i)];
  }
  float f32s(int64_t sb) const {
    const int64_t i = sidx(0, sb);
    return i < 0 ? 0.0f : m.scale[static_cast<size_t>(i)];
  }
};

uint64_t SplitMix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random panel source: values drawn in k order per row from a per-panel stream.
struct RandomPanel {
  WeightFormat f;
  int64_t rows_valid, kn, k_total;
  uint64_t seed;
  int64_t k_off;  // global k of panel-local k = 0 (node splits see the same weights)
  int group;
  uint64_t h(int c, int64_t k) const {
    k = k < 0 ? k : k + k_off;
    uint64_t s =
        seed ^ (static_cast<uint64_t>(c) << 40) ^ static_cast<uint64_t>(k) * 0x2545f4914f6cdd1dull;
    return SplitMix(s);
  }
  bool in(int c, int64_t k) const { return c < rows_valid && k < kn; }
  uint16_t bf16(int c, int64_t k) const {
    if (!in(c, k)) return 0;
    const float u = static_cast<float>(h(c, k) >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f;
    return F32ToBf16(u / std::sqrt(static_cast<float>(k_total)));
  }
  int q(int c, int64_t k) const {
    if (!in(c, k)) return 0;
    const uint64_t r = h(c, k);
    return f == WeightFormat::kInt8 ? static_cast<int>(r % 255) - 127
                                    : static_cast<int>(r & 15) - 8;
  }
  float scale(int c) const {
    return c < rows_valid
               ? 1.0f / (127.0f * std::sqrt(static_cast<float>(k_total))) *
                     (0.5f + static_cast<float>(h(c, -1) >> 40) / static_cast<float>(1 << 24))
               : 0.0f;
  }
  float gscale(int c, int64_t gi) const {
    return c < rows_valid
               ? 1.0f / (7.0f * std::sqrt(static_cast<float>(k_total))) *
                     (0.5f + static_cast<float>(h(c, -2 - gi - (group ? k_off / group : 0)) >> 40) /
                                 static_cast<float>(1 << 24))
               : 0.0f;
  }
  // Native formats: uniform codes (e4m3 without its NaN codes) and scales
  // that put the weights' magnitude near 1/sqrt(K).
  uint8_t code(int c, int64_t k) const {
    if (!in(c, k)) return 0;
    const uint64_t r = h(c, k);
    if (Traits(f).bits == 4) return static_cast<uint8_t>(r & 15);
    const int v = static_cast<int>(r % 254);  // 0..253, then 0x7F skipped: never NaN
    return static_cast<uint8_t>(v >= 0x7F ? v + 1 : v);
  }
  float unit(int c, int64_t gi) const {
    return 0.5f + static_cast<float>(h(c, -2 - gi - (group ? k_off / group : 0)) >> 40) /
                      static_cast<float>(1 << 24);
  }
  int log2_sqrt_k() const { return static_cast<int>(std::lround(0.5 * std::log2(k_total))); }
  uint8_t e8m0(int c, int64_t gi) const {
    if (c >= rows_valid) return 0;
    const int emax = f == WeightFormat::kMxfp4 ? 2 : 8;  // the element's largest binade
    return static_cast<uint8_t>(127 - emax - log2_sqrt_k() + (unit(c, gi) >= 1.0f ? 1 : 0));
  }
  uint16_t bf16s(int c, int64_t gi) const {
    return c < rows_valid ? F32ToBf16(unit(c, gi) / (7.0f * std::sqrt(static_cast<float>(k_total))))
                          : 0;
  }
  float f32s(int64_t sb) const {
    return rows_valid > 0 ? unit(0, sb) / (448.0f * std::sqrt(static_cast<float>(k_total))) : 0.0f;
  }
};

absl::Status CheckOptions(int64_t hidden, int64_t inter, int64_t experts, const PackOptions& o,
                          int64_t* i1, int64_t* e1) {
  RETURN_IF_ERROR(CheckQuantOptions(o, hidden, inter, experts));
  *i1 = o.i_end < 0 ? inter : o.i_end;
  *e1 = o.expert_end < 0 ? experts : o.expert_end;
  if (o.expert_begin < 0 || o.expert_begin >= *e1 || *e1 > experts)
    return absl::InvalidArgumentError(
        absl::StrCat("bad expert range [", o.expert_begin, ", ", *e1, ") of ", experts));
  return absl::OkStatus();
}

}  // namespace

int64_t PackedMoeLayer::expert_bytes() const {
  int64_t b = 0;
  for (const Part& p : parts_) b += p.expert_stride;
  return b;
}

absl::StatusOr<PackedMoeLayer> PackedMoeLayer::Plan(int64_t hidden, int64_t intermediate,
                                                    int64_t num_experts, const PackOptions& o,
                                                    const ThreadPool& pool) {
  int64_t i1, e1;
  RETURN_IF_ERROR(CheckOptions(hidden, intermediate, num_experts, o, &i1, &e1));
  PackedMoeLayer L;
  L.format_ = o.format;
  L.group_ = IsGrouped(o.format) ? o.group : 0;
  L.hidden_ = hidden;
  L.i_begin_ = o.i_begin;
  L.i_end_ = i1;
  L.expert_begin_ = o.expert_begin;
  L.expert_end_ = e1;
  const int nparts = pool.num_nodes();
  const int64_t is = i1 - o.i_begin, align = KAlign(o.format, o.group);
  int64_t prev = 0;
  for (int p = 0; p < nparts; ++p) {
    int64_t b = p + 1 == nparts ? is : std::min(is, RoundUp(is * (p + 1) / nparts, align));
    b = std::max(b, prev);
    Part part;
    part.i0 = o.i_begin + prev;
    part.i1 = o.i_begin + b;
    const int64_t in = b - prev;
    part.gu = MakeGeom(o.format, o.group, 2 * RoundUp(in, 16), hidden);
    part.down = MakeGeom(o.format, o.group, hidden, in);
    part.expert_stride = in > 0 ? part.gu.bytes() + part.down.bytes() : 0;
    L.parts_.push_back(std::move(part));
    prev = b;
  }
  return L;
}

std::map<int, int64_t> PackedMoeLayer::NodeBytes(const ThreadPool& pool) const {
  std::map<int, int64_t> out;
  for (size_t p = 0; p < parts_.size(); ++p)
    out[pool.mem_node(static_cast<int>(p))] +=
        (parts_[p].expert_stride * num_local_experts() + 4095) / 4096 * 4096;  // as allocated
  return out;
}

absl::StatusOr<PackedMoeLayer> PackedMoeLayer::Allocate(int64_t hidden, int64_t intermediate,
                                                        int64_t num_experts, const PackOptions& o,
                                                        const ThreadPool& pool) {
  ASSIGN_OR_RETURN(PackedMoeLayer L, Plan(hidden, intermediate, num_experts, o, pool));
  for (size_t p = 0; p < L.parts_.size(); ++p) {
    Part& part = L.parts_[p];
    if (part.expert_stride > 0) {
      ASSIGN_OR_RETURN(part.mem, NumaBuffer::Allocate(static_cast<size_t>(part.expert_stride *
                                                                          L.num_local_experts()),
                                                      pool.mem_node(static_cast<int>(p))));
    }
  }
  return L;
}

absl::StatusOr<PackedMoeLayer> PackedMoeLayer::Aliased(std::shared_ptr<const PackedMoeLayer> base,
                                                       int64_t intermediate, int64_t num_experts,
                                                       const PackOptions& o, const ThreadPool& pool,
                                                       std::vector<int32_t> alias) {
  if (base == nullptr) return absl::InvalidArgumentError("aliased layer: no base layer");
  ASSIGN_OR_RETURN(PackedMoeLayer L, Plan(base->hidden(), intermediate, num_experts, o, pool));
  if (static_cast<int64_t>(alias.size()) != L.num_local_experts())
    return absl::InvalidArgumentError(absl::StrCat("aliased layer: ", alias.size(), " aliases for ",
                                                   L.num_local_experts(), " experts"));
  for (int32_t a : alias)
    if (a < 0 || a >= base->num_local_experts())
      return absl::InvalidArgumentError(absl::StrCat("aliased layer: alias ", a,
                                                     " outside the base layer's ",
                                                     base->num_local_experts(), " experts"));
  if (L.format() != base->format() || L.group() != base->group() ||
      L.parts_.size() != base->parts().size())
    return absl::InvalidArgumentError("aliased layer: the base layer has another format or split");
  for (size_t p = 0; p < L.parts_.size(); ++p) {
    Part& part = L.parts_[p];
    const Part& b = base->parts()[p];
    if (part.i0 != b.i0 || part.i1 != b.i1 || part.expert_stride != b.expert_stride)
      return absl::InvalidArgumentError(
          absl::StrCat("aliased layer: part ", p, " is intermediate [", part.i0, ", ", part.i1,
                       "), the base layer's [", b.i0, ", ", b.i1, ")"));
    part.shared = std::shared_ptr<const NumaBuffer>(base, &b.mem);
    part.alias = alias;
  }
  return L;
}

namespace {

// A quantized matrix that is `rows` x `cols` in the layer's format (and int4
// group) with every vector of the length its readers index.
absl::Status CheckQuantMatrix(const QuantMatrix& m, const char* name, int64_t rows, int64_t cols,
                              const PackedMoeLayer& L) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("PackExpert: ", name, ": ", what, "; the layer is ",
                     std::string(WeightFormatName(L.format())),
                     IsGrouped(L.format()) ? absl::StrCat(" group ", L.group()) : "", " [", rows,
                     " x ", cols, "]"));
  };
  if (m.rows != rows || m.cols != cols) return bad(absl::StrCat("[", m.rows, " x ", m.cols, "]"));
  if (m.format != L.format()) return bad(std::string(WeightFormatName(m.format)));
  if (IsGrouped(L.format()) && m.group != L.group()) return bad(absl::StrCat("group ", m.group));
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t scales = static_cast<size_t>(ScaleCount(L.format(), L.group(), rows, cols));
  if (IsNativeFormat(L.format())) {
    const WeightFormat f = L.format();
    const size_t codes = static_cast<size_t>(rows * RowBytes(f, cols));
    const size_t have = Traits(f).scale_type == ScaleType::kE8M0   ? m.scale_e8m0.size()
                        : Traits(f).scale_type == ScaleType::kBf16 ? m.scale_bf16.size()
                                                                   : m.scale.size();
    if (m.packed.size() != codes || have != scales)
      return bad(absl::StrCat(m.packed.size(), " code bytes and ", have, " scales, want ", codes,
                              " and ", scales));
    // What the kernels cannot serve: a NaN scale or code (refused, not served as NaN).
    for (size_t i = 0; i < m.scale_e8m0.size() && f != WeightFormat::kInt4Bf16; ++i)
      if (m.scale_e8m0[i] == kE8M0NaN) return bad(absl::StrCat("e8m0 scale ", i, " is 0xFF (NaN)"));
    for (size_t i = 0; i < m.scale.size() && f == WeightFormat::kFp8; ++i)
      if (!std::isfinite(m.scale[i])) return bad(absl::StrCat("scale ", i, " is ", m.scale[i]));
    for (size_t i = 0; i < m.scale_bf16.size() && f == WeightFormat::kInt4Bf16; ++i)
      if (!std::isfinite(Bf16ToF32(m.scale_bf16[i])))
        return bad(absl::StrCat("scale ", i, " is ", Bf16ToF32(m.scale_bf16[i])));
    if (Traits(f).bits == 8)
      for (size_t i = 0; i < m.packed.size(); ++i)
        if ((m.packed[i] & 0x7F) == 0x7F)
          return bad(absl::StrCat("e4m3 code at [", static_cast<int64_t>(i) / cols, ", ",
                                  static_cast<int64_t>(i) % cols, "] is NaN"));
    return absl::OkStatus();
  }
  const bool sizes_ok = L.format() == WeightFormat::kBf16
                            ? m.bf16.size() == n
                            : m.q.size() == n && m.scale.size() == scales;
  if (!sizes_ok)
    return bad(absl::StrCat(m.bf16.size(), " bf16 / ", m.q.size(), " quantized values and ",
                            m.scale.size(), " scales"));
  return absl::OkStatus();
}

}  // namespace

absl::Status PackExpert(const QuantExpert& q, int64_t e, PackedMoeLayer& L) {
  const int64_t H = L.hidden(), is = L.i_end() - L.i_begin();
  RETURN_IF_ERROR(CheckQuantMatrix(q.gate, "gate", is, H, L));
  RETURN_IF_ERROR(CheckQuantMatrix(q.up, "up", is, H, L));
  RETURN_IF_ERROR(CheckQuantMatrix(q.down, "down", H, is, L));
  if (e < 0 || e >= L.num_local_experts()) return absl::OutOfRangeError("PackExpert: expert index");
  if (L.aliased())
    return absl::FailedPreconditionError("PackExpert: an aliased layer has no memory of its own");
  for (auto& part : L.mutable_parts()) {
    if (part.empty()) continue;
    const int64_t r0 = part.i0 - L.i_begin(), r1 = part.i1 - L.i_begin();
    uint8_t* gu = part.mutable_gate_up(e);
    for (int64_t j = 0; j < part.gu.nblocks / 2; ++j) {
      WritePanel(part.gu, MatrixWindow{q.gate, r0 + 16 * j, r1, 0, H},
                 gu + (2 * j) * part.gu.panel_bytes);
      WritePanel(part.gu, MatrixWindow{q.up, r0 + 16 * j, r1, 0, H},
                 gu + (2 * j + 1) * part.gu.panel_bytes);
    }
    uint8_t* dn = part.mutable_down(e);
    for (int64_t j = 0; j < part.down.nblocks; ++j)
      WritePanel(part.down, MatrixWindow{q.down, 16 * j, H, r0, r1 - r0},
                 dn + j * part.down.panel_bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantExpert> UnpackExpert(const PackedMoeLayer& L, int64_t e) {
  if (e < 0 || e >= L.num_local_experts())
    return absl::OutOfRangeError("UnpackExpert: expert index");
  const int64_t H = L.hidden(), is = L.i_end() - L.i_begin();
  const WeightFormat f = L.format();
  auto init = [&](QuantMatrix& m, int64_t rows, int64_t cols) {
    m.format = f;
    m.group = L.group();
    m.rows = rows;
    m.cols = cols;
    const size_t n = static_cast<size_t>(rows * cols);
    const size_t scales = static_cast<size_t>(ScaleCount(f, L.group(), rows, cols));
    if (f == WeightFormat::kBf16) {
      m.bf16.resize(n);
    } else if (IsNativeFormat(f)) {
      m.packed.resize(static_cast<size_t>(rows * RowBytes(f, cols)));
      if (Traits(f).scale_type == ScaleType::kE8M0) m.scale_e8m0.resize(scales);
      if (Traits(f).scale_type == ScaleType::kBf16) m.scale_bf16.resize(scales);
      if (Traits(f).scale_type == ScaleType::kF32) m.scale.resize(scales);
      return;
    } else {
      m.q.resize(n);
    }
    m.scale.resize(scales);
  };
  QuantExpert q;
  init(q.gate, is, H);
  init(q.up, is, H);
  init(q.down, H, is);
  auto put = [&](QuantMatrix& m, int64_t r, int64_t c, const PanelReader& pr, int pc, int64_t pk) {
    const size_t i = static_cast<size_t>(r * m.cols + c);
    if (IsNativeFormat(f)) {
      const uint8_t code = pr.code(pc, pk);
      const int64_t rb = RowBytes(f, m.cols);
      if (Traits(f).bits == 8) {
        m.packed[static_cast<size_t>(r * rb + c)] = code;
      } else {
        uint8_t& b = m.packed[static_cast<size_t>(r * rb + c / 2)];
        b = (c & 1) ? static_cast<uint8_t>((b & 0x0F) | (code << 4))
                    : static_cast<uint8_t>((b & 0xF0) | code);
      }
      if (pk % L.group() == 0) {
        const size_t si = static_cast<size_t>(ScaleIndex(f, L.group(), m.cols, r, c));
        if (f == WeightFormat::kFp8) m.scale[si] = pr.f32s(pk / L.group());
        if (f == WeightFormat::kInt4Bf16) m.scale_bf16[si] = pr.bf16s(pc, pk / L.group());
        if (f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8)
          m.scale_e8m0[si] = pr.e8m0(pc, pk / L.group());
      }
      return;
    }
    if (f == WeightFormat::kBf16)
      m.bf16[i] = pr.bf16(pc, pk);
    else
      m.q[i] = static_cast<int8_t>(pr.q(pc, pk));
    if (f == WeightFormat::kInt8 && c == 0) m.scale[static_cast<size_t>(r)] = pr.scale(pc);
    if (f == WeightFormat::kInt4 && pk % L.group() == 0) {
      const int64_t ng = (m.cols + L.group() - 1) / L.group();
      m.scale[static_cast<size_t>(r * ng + c / L.group())] = pr.gscale(pc, pk / L.group());
    }
  };
  for (const auto& part : L.parts()) {
    if (part.empty()) continue;
    const int64_t r0 = part.i0 - L.i_begin(), in = part.i1 - part.i0;
    for (int64_t r = 0; r < in; ++r) {
      const int64_t j = r / 16;
      const int c = static_cast<int>(r % 16);
      PanelReader pg{part.gu, part.gate_up(e) + (2 * j) * part.gu.panel_bytes};
      PanelReader pu{part.gu, part.gate_up(e) + (2 * j + 1) * part.gu.panel_bytes};
      for (int64_t k = 0; k < H; ++k) {
        put(q.gate, r0 + r, k, pg, c, k);
        put(q.up, r0 + r, k, pu, c, k);
      }
    }
    for (int64_t r = 0; r < H; ++r) {
      PanelReader pd{part.down, part.down_w(e) + (r / 16) * part.down.panel_bytes};
      for (int64_t k = 0; k < in; ++k) put(q.down, r, r0 + k, pd, static_cast<int>(r % 16), k);
    }
  }
  return q;
}

absl::StatusOr<PackedMoeLayer> PackRandom(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                          const PackOptions& o, ThreadPool& pool, uint64_t seed) {
  ASSIGN_OR_RETURN(PackedMoeLayer L,
                   PackedMoeLayer::Allocate(hidden, intermediate, num_experts, o, pool));
  const int64_t E = L.num_local_experts();
  auto& parts = L.mutable_parts();
  // Tasks: (part, expert, matrix 0/1) x panel chunks of 16.
  struct T {
    int p;
    int64_t e;
    int mat;
    int64_t j0, j1;
  };
  std::vector<T> tasks;
  for (int p = 0; p < static_cast<int>(parts.size()); ++p) {
    if (parts[p].empty()) continue;
    for (int64_t e = 0; e < E; ++e)
      for (int mat = 0; mat < 2; ++mat) {
        const int64_t nb = mat == 0 ? parts[p].gu.nblocks : parts[p].down.nblocks;
        for (int64_t j = 0; j < nb; j += 16) tasks.push_back({p, e, mat, j, std::min(nb, j + 16)});
      }
  }
  pool.ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t ti, const Worker&) {
    const T& t = tasks[static_cast<size_t>(ti)];
    auto& part = parts[static_cast<size_t>(t.p)];
    const int64_t in = part.i1 - part.i0;
    const PackedGeom& g = t.mat == 0 ? part.gu : part.down;
    uint8_t* base = t.mat == 0 ? part.mutable_gate_up(t.e) : part.mutable_down(t.e);
    for (int64_t j = t.j0; j < t.j1; ++j) {
      // Global row index of the panel's first row (so node splits see the same weights).
      const int64_t grow = t.mat == 0 ? (part.i0 + 16 * (j / 2)) : 16 * j;
      const int64_t rows_valid = t.mat == 0
                                     ? std::min<int64_t>(16, part.i1 - (part.i0 + 16 * (j / 2)))
                                     : std::min<int64_t>(16, hidden - 16 * j);
      const uint64_t s = seed * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(t.e) << 48) ^
                         (static_cast<uint64_t>(t.mat * 2 + (t.mat == 0 ? (j & 1) : 0)) << 44) ^
                         (static_cast<uint64_t>(grow) << 20);
      RandomPanel rp{L.format(),
                     rows_valid,
                     t.mat == 0 ? hidden : in,
                     t.mat == 0 ? hidden : L.i_end() - L.i_begin(),
                     s,
                     t.mat == 0 ? 0 : part.i0 - L.i_begin(),
                     L.group()};
      WritePanel(g, rp, base + j * g.panel_bytes);
    }
  });
  return L;
}

absl::StatusOr<PackedMoeLayer> Pack(const MoeWeightsSource& src, const PackOptions& o,
                                    ThreadPool& pool) {
  if (!src.expert) return absl::InvalidArgumentError("MoeWeightsSource.expert is not set");
  ASSIGN_OR_RETURN(PackedMoeLayer L, PackedMoeLayer::Allocate(src.hidden, src.intermediate,
                                                              src.num_experts, o, pool));
  std::mutex mu;
  absl::Status status;
  pool.ParallelFor(L.num_local_experts(), [&](int64_t e, const Worker&) {
    auto fail = [&](const absl::Status& s) {
      std::lock_guard<std::mutex> l(mu);
      if (status.ok()) status = Annotate(s, absl::StrCat("expert ", L.expert_begin() + e));
    };
    auto w = src.expert(L.expert_begin() + e);
    if (!w.ok()) return fail(w.status());
    auto q = QuantizeExpert(*w, src, o);
    if (!q.ok()) return fail(q.status());
    if (auto s = PackExpert(*q, e, L); !s.ok()) fail(s);
  });
  RETURN_IF_ERROR(status);
  return L;
}

}  // namespace hmoe
