#include "common/transport/ucx_wire.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

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

namespace {

// The host of host:port, [v6]:port (or of a bare host).
std::string HostOf(const std::string& address) {
  std::string host = address;
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    host = close == std::string::npos ? host.substr(1) : host.substr(1, close - 1);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  return host;
}

}  // namespace

absl::StatusOr<std::string> UcxNetDeviceFor(const std::string& listen) {
  std::string host = HostOf(listen);
  if (host.empty() || host == "0.0.0.0" || host == "::") return std::string();
  if (host == "localhost") host = "127.0.0.1";
  in_addr v4{};
  in6_addr v6{};
  const bool is4 = inet_pton(AF_INET, host.c_str(), &v4) == 1;
  const bool is6 = !is4 && inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  if (!is4 && !is6) return std::string();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0)
    return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  std::string name;
  for (ifaddrs* a = list; a != nullptr && name.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (is4 && a->ifa_addr->sa_family == AF_INET) {
      const auto* s = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      // 127.0.0.0/8 is all on the loopback device.
      const bool loop4 = (ntohl(v4.s_addr) >> 24) == 127 && (a->ifa_flags & IFF_LOOPBACK);
      if (s->sin_addr.s_addr == v4.s_addr || loop4) name = a->ifa_name;
    } else if (is6 && a->ifa_addr->sa_family == AF_INET6) {
      const auto* s = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      if (std::memcmp(&s->sin6_addr, &v6, sizeof(v6)) == 0) name = a->ifa_name;
    }
  }
  freeifaddrs(list);
  if (name.empty())
    return absl::NotFoundError(
        absl::StrCat("no local network interface holds ", host, " (from ", listen, ")"));
  return name;
}

std::string UcxNetDevicesForTargets(const std::vector<std::string>& targets) {
  std::set<std::string> devices;
  for (const std::string& target : targets) {
    std::string host = HostOf(target);
    if (host == "localhost") host = "127.0.0.1";
    sockaddr_storage to{};
    socklen_t to_len = 0;
    auto* v4 = reinterpret_cast<sockaddr_in*>(&to);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&to);
    if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
      v4->sin_port = htons(9);
      to_len = sizeof(*v4);
    } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(9);
      to_len = sizeof(*v6);
    } else {
      return std::string();  // a name: UCX's default
    }
    // The source address the kernel picks for it (a UDP connect sends nothing).
    const int fd = ::socket(to.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return std::string();
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const bool routed = ::connect(fd, reinterpret_cast<sockaddr*>(&to), to_len) == 0 &&
                        ::getsockname(fd, reinterpret_cast<sockaddr*>(&from), &from_len) == 0;
    ::close(fd);
    if (!routed) return std::string();
    char text[INET6_ADDRSTRLEN] = {};
    const void* a =
        from.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&from)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&from)->sin6_addr);
    if (inet_ntop(from.ss_family, a, text, sizeof(text)) == nullptr) return std::string();
    absl::StatusOr<std::string> dev = UcxNetDeviceFor(
        from.ss_family == AF_INET6 ? absl::StrCat("[", text, "]:0") : absl::StrCat(text, ":0"));
    if (!dev.ok() || dev->empty()) return std::string();
    devices.insert(*dev);
  }
  std::string out;
  for (const std::string& d : devices) absl::StrAppend(&out, out.empty() ? "" : ",", d);
  return out;
}

}  // namespace hmoe
