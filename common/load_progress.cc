#include "common/load_progress.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/systemd_notify.h"

namespace hmoe {
namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Unit {
  double div;
  const char* name;
};

Unit UnitFor(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return {double(int64_t{1} << 30), "GiB"};
  if (bytes >= (int64_t{1} << 20)) return {double(int64_t{1} << 20), "MiB"};
  if (bytes >= (int64_t{1} << 10)) return {1024.0, "KiB"};
  return {1.0, "B"};
}

std::string Amount(int64_t bytes, const Unit& u) {
  if (u.div == 1.0) return absl::StrCat(bytes);
  return absl::StrFormat("%.1f", static_cast<double>(bytes) / u.div);
}

std::string Duration(double s) {
  const int64_t t = static_cast<int64_t>(std::ceil(std::max(0.0, s)));
  if (t < 60) return absl::StrCat(t, " s");
  if (t < 3600) return absl::StrCat(t / 60, " min ", t % 60, " s");
  return absl::StrCat(t / 3600, " h ", t % 3600 / 60, " min");
}

constexpr double kNever = -std::numeric_limits<double>::infinity();

}  // namespace

LoadProgressOptions ProcessLoadProgressOptions(std::string what,
                                               std::function<void(const std::string&)> log) {
  LoadProgressOptions o;
  o.what = std::move(what);
  o.terminal = ::isatty(STDERR_FILENO) == 1;
  o.log = std::move(log);
  if (SystemdNotifySocketSet())
    o.status = [](const std::string& text) { NotifySystemd("STATUS=" + text); };
  return o;
}

LoadProgressReporter::LoadProgressReporter(LoadProgressOptions options)
    : o_(std::move(options)),
      start_(o_.now ? o_.now() : SteadySeconds()),
      last_line_(o_.terminal ? kNever : start_),
      last_status_(kNever) {
  if (!o_.write)
    o_.write = [](std::string_view s) {
      std::fwrite(s.data(), 1, s.size(), stderr);
      std::fflush(stderr);
    };
  if (!o_.log) o_.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
}

double LoadProgressReporter::Now() const { return o_.now ? o_.now() : SteadySeconds(); }

int64_t LoadProgressReporter::done() const {
  const int64_t d = done_.load(), t = total_.load();
  return t > 0 ? std::min(d, t) : d;
}

void LoadProgressReporter::SetTotal(int64_t bytes) {
  total_.store(std::max<int64_t>(0, bytes));
  Emit(false);
}

void LoadProgressReporter::AddTotal(int64_t bytes) {
  total_.fetch_add(std::max<int64_t>(0, bytes));
  Emit(false);
}

void LoadProgressReporter::Add(int64_t bytes) {
  if (bytes > 0) done_.fetch_add(bytes);
  Emit(false);
}

void LoadProgressReporter::Update(int64_t done, int64_t total) {
  total_.store(std::max<int64_t>(0, total));
  int64_t cur = done_.load();
  while (done > cur && !done_.compare_exchange_weak(cur, done)) {
  }
  Emit(false);
}

void LoadProgressReporter::Finish() {
  if (finished_.exchange(true)) return;
  Emit(true);
}

std::string LoadProgressReporter::Line() const { return Text(Now(), false); }
std::string LoadProgressReporter::FinalLine() const { return Text(Now(), true); }

std::string LoadProgressReporter::Text(double now, bool final) const {
  const int64_t total = total_.load(), done = this->done();
  const double elapsed = now - start_;
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;  // bytes/s
  const Unit u = UnitFor(std::max(total, done));
  const std::string rate_text = absl::StrFormat("%.1f GB/s", rate / 1e9);
  if (final) {
    if (total > 0 && done < total)
      return absl::StrCat(o_.what, ": stopped at ", Amount(done, u), " / ", Amount(total, u), " ",
                          u.name, " after ", absl::StrFormat("%.1f", elapsed), " s, ", rate_text);
    return absl::StrCat(o_.what, ": ", Amount(done, u), " ", u.name, " in ",
                        absl::StrFormat("%.1f", elapsed), " s, ", rate_text, " mean");
  }
  std::string text = absl::StrCat(o_.what, ": ", Amount(done, u));
  if (total > 0) absl::StrAppend(&text, " / ", Amount(total, u));
  absl::StrAppend(&text, " ", u.name);
  if (done > 0 && elapsed > 0) {
    absl::StrAppend(&text, ", ", rate_text);
    if (total > 0) absl::StrAppend(&text, ", ETA ", Duration((total - done) / rate));
  }
  return text;
}

void LoadProgressReporter::Emit(bool final) {
  if (final) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string text = Text(Now(), true);
    if (o_.terminal)
      o_.write(absl::StrCat("\r", text, "\x1b[K\n"));
    else
      o_.log(text);
    if (o_.status) o_.status(text);
    return;
  }
  if (finished_.load()) return;
  // Another thread emitting now: this update shows in the next line.
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || finished_.load()) return;
  const double now = Now();
  const double period = o_.terminal ? o_.redraw_period_s : o_.log_period_s;
  const bool line_due = now - last_line_ >= period;
  const bool status_due = o_.status && now - last_status_ >= o_.status_period_s;
  if (!line_due && !status_due) return;
  const std::string text = Text(now, false);
  if (line_due) {
    last_line_ = now;
    if (o_.terminal) {
      o_.write(absl::StrCat("\r", text, "\x1b[K"));
    } else {
      o_.log(text);
    }
  }
  if (status_due) {
    last_status_ = now;
    o_.status(text);
  }
}

}  // namespace hmoe
