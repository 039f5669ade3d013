// Runs hmoe-expert-service as a child process for end-to-end tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace hmoe::testing {

inline std::string BenchBinary() { return std::string(HMOE_BINARY_DIR) + "/bin/hmoe-expert-bench"; }

inline std::string ServiceBinary() {
  const char* env = std::getenv("HMOE_EXPERT_SERVICE_BIN");
  return env ? env : std::string(HMOE_BINARY_DIR) + "/bin/hmoe-expert-service";
}

class ServiceProcess {
 public:
  ServiceProcess() = default;
  ServiceProcess(const ServiceProcess&) = delete;
  ~ServiceProcess() { Kill(SIGKILL); }

  // Starts the service with `args` (plus --listen/--port-file) and waits until
  // it is ready (port file written). port 0: pick one.
  // `prefix` runs it through another command (e.g. {"ip", "netns", "exec", NS}).
  bool Start(const std::vector<std::string>& args, const std::string& port_file, int port = 0,
             const std::string& host = "127.0.0.1", const std::vector<std::string>& prefix = {}) {
    port_file_ = port_file;
    host_ = host;
    prefix_ = prefix;
    std::remove(port_file.c_str());
    std::vector<std::string> argv = prefix;
    argv.push_back(binary_.empty() ? ServiceBinary() : binary_);
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--listen=" + host + ":" + std::to_string(port));
    argv.push_back("--port-file=" + port_file);
    args_ = args;
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    pid_t spawned = -1;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!stderr_file_.empty()) {
      posix_spawn_file_actions_addopen(&actions, 2, stderr_file_.c_str(),
                                       O_WRONLY | O_CREAT | O_APPEND, 0600);
    }
    const int spawn_error =
        posix_spawnp(&spawned, cargv[0], &actions, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (spawn_error != 0) return false;
    pid_ = spawned;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < until) {
      std::ifstream f(port_file);
      if (f >> port_) return true;
      int status;
      const pid_t r = waitpid(spawned, &status, WNOHANG);
      if (r == spawned) {
        exit_status_ = status;
        pid_ = -1;
        return false;
      }
      if (r < 0) return false;  // reaped by Kill on another thread
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Same arguments and port as before (after Kill).
  bool Restart() { return Start(args_, port_file_, port_, host_, prefix_); }

  // Sends `sig`; for SIGSTOP, returns once the process is stopped.
  void Signal(int sig) {
    // One read: Start (on another thread) may set pid_ to -1 meanwhile, and
    // kill(-1, sig) signals every process.
    const pid_t pid = pid_.load();
    if (pid <= 0) return;
    ::kill(pid, sig);
    if (sig != SIGSTOP) return;
    for (int i = 0; i < 1000; ++i) {
      std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
      std::string pid, comm, state;
      f >> pid >> comm >> state;
      if (state == "T" || state == "t") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // Sends `sig` and reaps; returns the wait status (or -1).
  int Kill(int sig) {
    const pid_t pid = pid_.exchange(-1);  // one read (see Signal)
    if (pid <= 0) return -1;
    ::kill(pid, sig);
    if (sig != SIGKILL) ::kill(pid, SIGCONT);
    int status = -1;
    waitpid(pid, &status, 0);
    return status;
  }
  // Waits up to `timeout_ms` for the process to exit by itself; its wait
  // status, or -1 if it still runs.
  int WaitExit(int timeout_ms) {
    const pid_t pid = pid_.load();
    if (pid <= 0) return -1;
    for (int i = 0; i < timeout_ms / 10 + 1; ++i) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid_.store(-1);
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  // Another program with the same --listen / --port-file contract
  // (e.g. hmoe-gpu-worker); default: hmoe-expert-service.
  void set_binary(std::string path) { binary_ = std::move(path); }
  // The process's stderr goes (appended) to `path` from the next Start on.
  void set_stderr_file(std::string path) { stderr_file_ = std::move(path); }
  int pid() const { return pid_; }
  // The wait status of a service that exited while Start waited for it (-1: none).
  int exit_status() const { return exit_status_; }
  int port() const { return port_; }
  std::string target() const { return host_ + ":" + std::to_string(port_); }

 private:
  std::atomic<pid_t> pid_{-1};  // Start may run on another thread than Signal
  std::atomic<int> exit_status_{-1};
  int port_ = 0;
  std::string port_file_;
  std::string host_ = "127.0.0.1";
  std::vector<std::string> args_, prefix_;
  std::string binary_;
  std::string stderr_file_;
};

// Whether the file at `path` (a process's log) contains `text` at least
// `times` times, waiting up to 10 s for it (a line a process logs again on
// each signal: count the ones sent so far).
inline bool FileSays(const std::string& path, const std::string& text, int times = 1) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream f(path);
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    int n = 0;
    for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
    if (n >= times) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Runs a shell command line; its exit status (as from pclose) and its
// stdout (the line's own redirections decide what else goes there).
struct CommandResult {
  int status = -1;
  std::string output;
};
inline CommandResult RunCommand(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) r.output += buf;
  r.status = pclose(p);
  return r;
}

// The local addresses process `pid` has TCP sockets listening on, as
// /proc/net/tcp and tcp6 print them (hex address:port).
inline std::vector<std::string> ListeningAddresses(int pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(e.path(), lec).string();
    if (!lec && target.rfind("socket:[", 0) == 0)
      inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream f(table);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string sl, local, remote, state, skip, inode;
      in >> sl >> local >> remote >> state;
      for (int i = 0; i < 5; ++i) in >> skip;  // tx:rx tr:when retrnsmt uid timeout
      in >> inode;
      if (state == "0A" && inodes.count(inode)) out.push_back(local);
    }
  }
  return out;
}

// Whether a ListeningAddresses entry is on loopback: 127.x.x.x as
// /proc/net/tcp prints it (little-endian hex, first byte last), or ::1 /
// ::ffff:127.x in tcp6.
inline bool IsLoopbackAddress(const std::string& listening) {
  const std::string addr = listening.substr(0, listening.find(':'));
  const bool loop4 = addr.size() == 8 && addr.substr(6, 2) == "7F";
  const bool loop6 =
      addr == "00000000000000000000000001000000" ||
      (addr.size() == 32 && addr.substr(16, 8) == "FFFF0000" && addr.substr(30, 2) == "7F");
  return loop4 || loop6;
}

}  // namespace hmoe::testing
