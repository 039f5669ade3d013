#include "common/auth_token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/small_file.h"
#include "common/status.h"

namespace hmoe {

absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, const std::string& what,
                                               int64_t max_bytes, uint32_t* mode) {
  return ReadSmallFile(path, max_bytes, what, mode);
}

namespace {

// One token's checks; `what` names the file (and line).
absl::Status CheckToken(const std::string& what, absl::string_view token) {
  if (token.size() > kMaxAuthTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": token of ", token.size(), " bytes, over the ", kMaxAuthTokenBytes));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: byte %zu is 0x%02x; a token is printable ASCII without spaces "
                          "(e.g. `head -c 32 /dev/urandom | base64 -w0`)",
                          what, i, static_cast<unsigned>(c)));
    }
  }
  if (token.size() < kMinAuthTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": token of ", token.size(), " bytes; at least ", kMinAuthTokenBytes,
                     " (e.g. `head -c 32 /dev/urandom | base64 -w0`)"));
  }
  return absl::OkStatus();
}

bool IsLineSpace(char c) { return c == '\r' || c == ' ' || c == '\t'; }

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadAuthTokensFile(const std::string& path) {
  const std::string what = absl::StrCat("auth token file ", path);
  uint32_t mode = 0;
  // The tokens, each with a line ending.
  auto read = ReadCredentialFile(
      path, what, static_cast<int64_t>(kMaxAuthTokensPerFile * (kMaxAuthTokenBytes + 2)), &mode);
  if (!read.ok()) return read.status();
  if ((mode & 0077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: mode %04o lets other users at the token; chmod 600 it", what, mode));
  }
  struct Line {
    size_t number;
    absl::string_view text;
  };
  std::vector<Line> lines;
  size_t number = 0;
  for (absl::string_view line : absl::StrSplit(*read, '\n')) {
    ++number;
    while (!line.empty() && IsLineSpace(line.back())) line.remove_suffix(1);
    if (!line.empty()) lines.push_back({number, line});
  }
  // An empty file says so in a single token's words.
  if (lines.empty()) lines.push_back({1, absl::string_view()});
  if (lines.size() > kMaxAuthTokensPerFile) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", lines.size(), " tokens, over the ", kMaxAuthTokensPerFile));
  }
  std::vector<std::string> tokens;
  for (const Line& l : lines) {
    RETURN_IF_ERROR(
        CheckToken(lines.size() == 1 ? what : absl::StrCat(what, ": line ", l.number), l.text));
    tokens.emplace_back(l.text);
  }
  return tokens;
}

absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, ReadAuthTokensFile(path));
  return std::move(tokens.front());
}

AuthTokens::AuthTokens(std::vector<std::string> tokens)
    : enabled_(!tokens.empty()), tokens_(std::move(tokens)) {}

absl::StatusOr<std::shared_ptr<AuthTokens>> AuthTokens::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, ReadAuthTokensFile(path));
  return std::make_shared<AuthTokens>(std::move(tokens));
}

bool AuthTokens::Accepts(absl::string_view token) const {
  std::lock_guard<std::mutex> lock(mu_);
  bool any = false;
  for (const std::string& t : tokens_) any |= AuthTokensEqual(token, t);
  return any;
}

std::string AuthTokens::first() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tokens_.empty() ? std::string() : tokens_.front();
}

std::string AuthTokens::ReloadForLog(const std::string& path) {
  auto n = Reload(path);
  if (!n.ok()) return absl::StrCat("kept the tokens in force: ", n.status().message());
  return absl::StrCat(path, " reloaded: ", *n, " token(s)");
}

absl::StatusOr<size_t> AuthTokens::Reload(const std::string& path) {
  if (!enabled_) {
    return absl::FailedPreconditionError(
        absl::StrCat("auth token file ", path, ": auth is off; a reload cannot turn it on"));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, ReadAuthTokensFile(path));
  std::lock_guard<std::mutex> lock(mu_);
  tokens_ = std::move(tokens);
  return tokens_.size();
}

bool IsLoopbackListenAddress(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  if (host == "localhost" || host == "[::1]") return true;
  if (absl::ConsumePrefix(&host, "[::ffff:") && !absl::ConsumeSuffix(&host, "]")) return false;
  // An IPv4 literal in 127.0.0.0/8.
  if (!absl::StartsWith(host, "127.")) return false;
  int dots = 0;
  for (char c : host) {
    if (c == '.')
      ++dots;
    else if (c < '0' || c > '9')
      return false;
  }
  return dots == 3;
}

bool AuthTokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  return diff == 0;
}

}  // namespace hmoe
