// The serving pair as real processes for end-to-end tests: expert-service
// shards plus one hmoe-gpu-worker, and a connected C++ client.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "proto/api.pb.h"
#include "sdk/client.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

namespace hmoe::testing {

inline std::string WorkerBinary() { return std::string(HMOE_BINARY_DIR) + "/bin/hmoe-gpu-worker"; }

// One expert service (or several shards) plus one worker.
class Pair {
 public:
  // `shards` expert-service processes with `split`; transport for the worker.
  bool Start(const std::string& model, int shards = 1, const std::string& split = "tp",
             const std::string& transport = "shm",
             const std::vector<std::string>& worker_extra = {},
             const std::vector<std::string>& expert_extra = {}) {
    std::string targets;
    for (int i = 0; i < shards; ++i) {
      experts_.push_back(std::make_unique<ServiceProcess>());
      std::vector<std::string> args = {
          "--model-dir=" + model, "--format=bf16",
          "--shard=" + std::to_string(i) + "/" + std::to_string(shards), "--split=" + split};
      args.insert(args.end(), expert_extra.begin(), expert_extra.end());
      if (capture_logs_) experts_.back()->set_stderr_file(log("expert" + std::to_string(i)));
      if (!experts_.back()->Start(args, dir_.file("expert" + std::to_string(i) + ".port")))
        return false;
      targets += (i ? "," : "") + experts_.back()->target();
    }
    worker_.set_binary(WorkerBinary());
    if (capture_logs_) worker_.set_stderr_file(log("worker"));
    std::vector<std::string> args = {"--model=" + model, "--experts=" + targets,
                                     "--transport=" + transport, "--threads=2",
                                     "--expert-timeout-ms=2000"};
    args.insert(args.end(), worker_extra.begin(), worker_extra.end());
    if (!worker_.Start(args, dir_.file("worker.port"))) return false;
    ClientOptions o;
    o.target = worker_.target();
    o.tls = client_tls_;
    o.auth_token = client_token_;
    auto c = Client::Connect(o);
    if (!c.ok()) return false;
    client_ = std::move(*c);
    return true;
  }
  // TLS for the client Start connects (before Start).
  void set_client_tls(TlsClientFiles tls) { client_tls_ = std::move(tls); }
  // The token the client Start connects sends (before Start).
  void set_client_token(std::string token) { client_token_ = std::move(token); }
  // A path in the pair's temporary directory (port files, token files).
  std::string file(const std::string& name) const { return dir_.file(name); }
  // The processes' stderr to files (before Start): log("worker"), log("expert0").
  void set_capture_logs() { capture_logs_ = true; }
  std::string log(const std::string& process) const { return dir_.file(process + ".log"); }
  Client& client() { return *client_; }
  ServiceProcess& worker() { return worker_; }
  ServiceProcess& expert(int i = 0) { return *experts_[static_cast<size_t>(i)]; }

 private:
  TempDir dir_;
  std::vector<std::unique_ptr<ServiceProcess>> experts_;
  ServiceProcess worker_;
  std::unique_ptr<Client> client_;
  TlsClientFiles client_tls_;
  std::string client_token_;
  bool capture_logs_ = false;
};

// Generate `r` until it succeeds, for up to 5 s (a shard coming back).
inline bool ServedWithin5s(Client& client, const api::v1::GenerateRequest& r) {
  for (int i = 0; i < 50; ++i) {
    if (client.Generate(r).ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

}  // namespace hmoe::testing
