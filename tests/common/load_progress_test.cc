#include "common/load_progress.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/systemd_notify.h"

namespace hmoe {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A reporter on a clock the test moves, its lines and status texts kept.
struct Harness {
  double t = 100;
  std::mutex mu;
  std::vector<std::string> lines, writes, statuses;
  LoadProgressOptions Options(bool terminal, bool status) {
    LoadProgressOptions o;
    o.terminal = terminal;
    o.now = [this] { return t; };
    o.log = [this](const std::string& s) {
      std::lock_guard<std::mutex> l(mu);
      lines.push_back(s);
    };
    o.write = [this](std::string_view s) {
      std::lock_guard<std::mutex> l(mu);
      writes.emplace_back(s);
    };
    if (status)
      o.status = [this](const std::string& s) {
        std::lock_guard<std::mutex> l(mu);
        statuses.push_back(s);
      };
    return o;
  }
};

TEST(LoadProgress, LineHasBytesRateAndEta) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  r.SetTotal(32 * kGiB);
  h.t += 4;
  r.Add(8 * kGiB);  // 8 GiB in 4 s: 2.147 GB/s; 24 GiB left: 12 s
  EXPECT_EQ(r.Line(), "loading weights: 8.0 / 32.0 GiB, 2.1 GB/s, ETA 12 s");
  h.t += 1;  // no new bytes: the mean rate falls, the ETA grows (8 GiB / 5 s -> 15 s)
  EXPECT_EQ(r.Line(), "loading weights: 8.0 / 32.0 GiB, 1.7 GB/s, ETA 15 s");
}

TEST(LoadProgress, LongEtasInMinutesAndHours) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  r.Update(kGiB, 200 * kGiB);
  h.t += 1;  // 199 s left
  EXPECT_NE(r.Line().find("ETA 3 min 19 s"), std::string::npos) << r.Line();
  h.t += 19;  // 20 s per GiB: 3980 s
  EXPECT_NE(r.Line().find("ETA 1 h 6 min"), std::string::npos) << r.Line();
}

TEST(LoadProgress, LogLinesOncePerPeriodThenTheFinalLine) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  r.SetTotal(80 << 20);
  for (int i = 1; i <= 80; ++i) {  // 1 MiB per 0.125 s: 10 s
    h.t += 0.125;
    r.Add(1 << 20);
  }
  // Lines at 5 s and 10 s, none at the start (a short load says only its end).
  ASSERT_EQ(h.lines.size(), 2u);
  EXPECT_EQ(h.lines[0], "loading weights: 40.0 / 80.0 MiB, 0.0 GB/s, ETA 5 s");
  r.Finish();
  r.Finish();  // once
  ASSERT_EQ(h.lines.size(), 3u);
  EXPECT_EQ(h.lines[2], "loading weights: 80.0 MiB in 10.0 s, 0.0 GB/s mean");
  r.Add(1 << 20);  // after Finish: nothing more
  EXPECT_EQ(h.lines.size(), 3u);
  EXPECT_TRUE(h.writes.empty());
}

TEST(LoadProgress, PeriodIsAnOption) {
  Harness h;
  LoadProgressOptions o = h.Options(false, false);
  o.log_period_s = 1;
  LoadProgressReporter r(o);
  r.SetTotal(10);
  for (int i = 0; i < 10; ++i) {
    h.t += 0.5;
    r.Add(1);
  }
  EXPECT_EQ(h.lines.size(), 5u);
}

TEST(LoadProgress, FinalLineSaysWhereAnUnfinishedLoadStopped) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  r.Update(3 * kGiB, 10 * kGiB);
  h.t += 2;
  r.Finish();
  ASSERT_EQ(h.lines.size(), 1u);
  EXPECT_EQ(h.lines[0], "loading weights: stopped at 3.0 / 10.0 GiB after 2.0 s, 1.6 GB/s");
}

TEST(LoadProgress, TerminalRewritesOneLine) {
  Harness h;
  LoadProgressOptions o = h.Options(true, false);
  o.what = "loading experts";
  LoadProgressReporter r(o);
  r.SetTotal(2 * kGiB);  // drawn at once
  h.t += 0.125;
  r.Add(kGiB / 2);  // within the redraw period: not drawn
  h.t += 0.125;
  r.Add(kGiB / 2);
  h.t += 0.25;
  r.Add(kGiB);
  r.Finish();
  ASSERT_EQ(h.writes.size(), 4u);
  EXPECT_EQ(h.writes[0], "\rloading experts: 0.0 / 2.0 GiB\x1b[K");
  EXPECT_EQ(h.writes[1].substr(0, 30), "\rloading experts: 1.0 / 2.0 Gi");
  EXPECT_EQ(h.writes[3], "\rloading experts: 2.0 GiB in 0.5 s, 4.3 GB/s mean\x1b[K\n");
  EXPECT_TRUE(h.lines.empty());
}

TEST(LoadProgress, StatusFollowsItsOwnPeriodAndTheEnd) {
  Harness h;
  LoadProgressReporter r(h.Options(false, true));
  r.SetTotal(10 * kGiB);  // the first status at once
  for (int i = 0; i < 10; ++i) {
    h.t += 0.5;
    r.Add(kGiB);
  }
  r.Finish();
  // t = 0, 1, 2, 3, 4, 5 (every second), and the final one.
  ASSERT_EQ(h.statuses.size(), 7u);
  EXPECT_EQ(h.statuses[0], "loading weights: 0.0 / 10.0 GiB");
  EXPECT_EQ(h.statuses.back(), h.lines.back());
}

TEST(LoadProgress, TotalZeroShowsBytesAndRateNoEta) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  EXPECT_EQ(r.Line(), "loading weights: 0 B");
  h.t += 1;
  r.Add(3 << 20);
  EXPECT_EQ(r.Line(), "loading weights: 3.0 MiB, 0.0 GB/s");
  r.Finish();
  EXPECT_EQ(h.lines.back(), "loading weights: 3.0 MiB in 1.0 s, 0.0 GB/s mean");
}

TEST(LoadProgress, DoneAboveTotalIsClamped) {
  Harness h;
  LoadProgressReporter r(h.Options(false, false));
  r.SetTotal(kGiB);
  h.t += 1;
  r.Add(3 * kGiB);
  EXPECT_EQ(r.done(), kGiB);
  EXPECT_EQ(r.Line(), "loading weights: 1.0 / 1.0 GiB, 1.1 GB/s, ETA 0 s");
  r.Update(kGiB / 2, kGiB);  // done never goes back
  EXPECT_EQ(r.done(), kGiB);
}

TEST(LoadProgress, ManyThreadsCountEveryByte) {
  Harness h;
  std::atomic<int> ticks{0};
  LoadProgressOptions o = h.Options(false, true);
  o.now = [&ticks] { return ticks.fetch_add(1) * 1e-3; };  // every reading 1 ms on
  o.log_period_s = 0.05;
  LoadProgressReporter r(o);
  constexpr int kThreads = 8, kAdds = 2000;
  r.SetTotal(int64_t{kThreads} * kAdds * 4096);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&r] {
      for (int j = 0; j < kAdds; ++j) r.Add(4096);
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(r.done(), r.total());
  r.Finish();
  EXPECT_GT(h.lines.size(), 1u);
  EXPECT_NE(h.lines.back().find("62.5 MiB in"), std::string::npos) << h.lines.back();
  for (const std::string& s : h.lines) EXPECT_EQ(s.rfind("loading weights: ", 0), 0u) << s;
}

// The systemd path: STATUS= as a datagram on the socket $NOTIFY_SOCKET names.
class NotifySocket : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             ("hmoe-notify-" + std::to_string(::getpid()) + ".sock"))
                .string();
    ::unlink(path_.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd_, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    ASSERT_LT(path_.size(), sizeof(a.sun_path));
    std::strcpy(a.sun_path, path_.c_str());
    ASSERT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    timeval tv{2, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const char* old = std::getenv("NOTIFY_SOCKET");
    if (old) old_ = old;
    ::setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  }
  void TearDown() override {
    if (old_)
      ::setenv("NOTIFY_SOCKET", old_->c_str(), 1);
    else
      ::unsetenv("NOTIFY_SOCKET");
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  std::string Receive() {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
  std::string path_;
  int fd_ = -1;
  std::optional<std::string> old_;
};

TEST_F(NotifySocket, ProcessOptionsSendStatusDatagrams) {
  ASSERT_TRUE(SystemdNotifySocketSet());
  double t = 0;
  LoadProgressOptions o = ProcessLoadProgressOptions("loading experts", [](const std::string&) {});
  ASSERT_TRUE(o.status);
  o.now = [&t] { return t; };
  LoadProgressReporter r(o);
  r.SetTotal(4 * kGiB);
  EXPECT_EQ(Receive(), "STATUS=loading experts: 0.0 / 4.0 GiB");
  t = 2;
  r.Add(kGiB);
  EXPECT_EQ(Receive(), "STATUS=loading experts: 1.0 / 4.0 GiB, 0.5 GB/s, ETA 6 s");
  t = 2.5;
  r.Add(3 * kGiB);
  r.Finish();
  EXPECT_EQ(Receive(), "STATUS=loading experts: 4.0 GiB in 2.5 s, 1.7 GB/s mean");
}

TEST_F(NotifySocket, UnsetSocketSendsNothing) {
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_FALSE(SystemdNotifySocketSet());
  EXPECT_FALSE(ProcessLoadProgressOptions("x").status);
  NotifySystemd("STATUS=nobody listens");  // no crash, no datagram
  timeval tv{0, 100000};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(Receive(), "");
}

}  // namespace
}  // namespace hmoe
