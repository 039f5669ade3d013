// Progress of a long load (a checkpoint's weights, a shard's experts, pinned
// copies): bytes done of a total, fed from any thread, shown as
//   loading weights: 12.3 / 31.9 GiB, 2.8 GB/s, ETA 7 s
// rewritten in place on a terminal, else as a log line every few seconds, and
// as the service manager's STATUS= when one listens; a final line gives the
// totals and the mean rate.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>

namespace hmoe {

struct LoadProgressOptions {
  std::string what = "loading weights";  // each line's prefix
  // true: one line rewritten in place ("\r" ... erase to the end of line) at
  // most every `redraw_period_s`, ended by the final line and a newline.
  // false: a log line at most every `log_period_s` (none before the first
  // period has passed), then the final one.
  bool terminal = false;
  double log_period_s = 5;
  double redraw_period_s = 0.2;
  // STATUS= at most this often (and the final line always).
  double status_period_s = 1;
  // Monotonic seconds; unset: std::chrono::steady_clock.
  std::function<double()> now;
  // Terminal mode's bytes; unset: stderr, flushed.
  std::function<void(std::string_view)> write;
  // Log mode's lines, without a newline; unset: stderr.
  std::function<void(const std::string&)> log;
  // The service manager's status text ("STATUS=" is the callee's); unset:
  // none.
  std::function<void(const std::string&)> status;
};

// Options for this process's stderr: a terminal when stderr is one, lines
// through `log` otherwise (unset: stderr), and STATUS= through NotifySystemd
// when $NOTIFY_SOCKET is set.
LoadProgressOptions ProcessLoadProgressOptions(std::string what,
                                               std::function<void(const std::string&)> log = {});

// Thread-safe: SetTotal / Add / Update from any thread; one of them emits
// when its period is due (others do not wait for it). Done is clamped to the
// total when a total is set; a total of 0 shows bytes and rate, no ETA.
class LoadProgressReporter {
 public:
  explicit LoadProgressReporter(LoadProgressOptions options);  // starts the clock
  LoadProgressReporter(const LoadProgressReporter&) = delete;
  LoadProgressReporter& operator=(const LoadProgressReporter&) = delete;

  void SetTotal(int64_t bytes);
  void AddTotal(int64_t bytes);
  void Add(int64_t bytes);
  // Absolute progress: done never goes back (the largest reported wins).
  void Update(int64_t done, int64_t total);
  // The final line (and status), once; later updates are ignored.
  void Finish();

  int64_t done() const;  // clamped as shown
  int64_t total() const { return total_.load(); }
  // The current progress text / the final text, without a newline.
  std::string Line() const;
  std::string FinalLine() const;

 private:
  double Now() const;
  void Emit(bool final);
  std::string Text(double now, bool final) const;

  LoadProgressOptions o_;
  const double start_;
  std::atomic<int64_t> done_{0}, total_{0};
  std::atomic<bool> finished_{false};
  std::mutex mu_;  // guards the emitters' state below
  double last_line_, last_status_;
};

}  // namespace hmoe
