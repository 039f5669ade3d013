#include "common/transport/ucx_wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

constexpr char kAddressListMagic[] = "HMOELNS1";
constexpr size_t kAddressListMagicBytes = 8;

void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

}  // namespace

bool IsUcxAddressList(const std::string& bytes) {
  return bytes.size() >= kAddressListMagicBytes &&
         std::memcmp(bytes.data(), kAddressListMagic, kAddressListMagicBytes) == 0;
}

absl::Status CheckUcxLanes(int lanes, const char* field) {
  if (lanes < 1 || lanes > kMaxUcxLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", lanes, " outside [1, ", kMaxUcxLanes, "]"));
  }
  return absl::OkStatus();
}

std::string EncodeUcxAddresses(const std::vector<std::string>& addresses) {
  if (addresses.size() == 1) return addresses[0];
  std::string s(kAddressListMagic, kAddressListMagicBytes);
  PutU32(&s, static_cast<uint32_t>(addresses.size()));
  for (const std::string& a : addresses) {
    PutU32(&s, static_cast<uint32_t>(a.size()));
    s += a;
  }
  return s;
}

absl::StatusOr<std::vector<std::string>> DecodeUcxAddresses(const std::string& bytes,
                                                            const char* field) {
  if (!IsUcxAddressList(bytes)) {
    if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty"));
    if (bytes.size() > kMaxUcxAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes.size(), " bytes, over the ",
                                                     kMaxUcxAddressBytes, " a UCX address takes"));
    }
    return std::vector<std::string>{bytes};
  }
  size_t at = kAddressListMagicBytes;
  auto cut_short = [&](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": lane list of ", bytes.size(),
                                                   " bytes ends inside ", what, " at byte ", at));
  };
  if (bytes.size() - at < 4) return cut_short("its count");
  const uint32_t n = GetU32(bytes.data() + at);
  at += 4;
  if (n < 1 || n > static_cast<uint32_t>(kMaxUcxLanes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": lane list of ", n, " addresses (1 to ", kMaxUcxLanes, ")"));
  }
  std::vector<std::string> out;
  for (uint32_t i = 0; i < n; ++i) {
    if (bytes.size() - at < 4) return cut_short("a length");
    const uint32_t len = GetU32(bytes.data() + at);
    at += 4;
    if (len == 0 || len > kMaxUcxAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": lane ", i, "'s address of ", len,
                                                     " bytes (1 to ", kMaxUcxAddressBytes, ")"));
    }
    if (bytes.size() - at < len) return cut_short("an address");
    out.emplace_back(bytes, at, len);
    at += len;
  }
  if (at != bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", bytes.size() - at, " bytes after the lane list's last address"));
  }
  return out;
}

}  // namespace hmoe
