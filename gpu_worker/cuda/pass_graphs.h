// The CUDA Graphs of slot passes: one per bucket (1, 2, 4, ... tokens),
// captured at its first pass and replayed after, each with the host-side
// arguments of its expert calls (CallRecord). A failed capture turns graphs
// off for good; the pass is then run again without one. Graphs hold the
// workspace's and the slots' addresses: Drop them when either moves.
// Internal to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "gpu_worker/cuda/expert_call_path.h"

namespace hmoe::cuda {

class PassGraphs {
 public:
  PassGraphs(bool on, cudaStream_t stream) : on_(on), stream_(stream) {}
  ~PassGraphs() { Drop(); }
  PassGraphs(const PassGraphs&) = delete;
  PassGraphs& operator=(const PassGraphs&) = delete;

  bool on() const { return on_; }
  // This pass: being captured (not run yet), replayed (already run), or
  // fallen back (its capture failed: run it again without a graph).
  bool capturing() const { return capturing_; }
  bool replayed() const { return replayed_; }
  bool fell_back() const { return fell_back_; }
  void set_fell_back() { fell_back_ = true; }
  void BeginPass() { replayed_ = fell_back_ = false; }
  void EndPass() { replayed_ = false; }

  // The record of bucket's graph when it can be replayed, else null.
  CallRecord* Replayable(int64_t bucket);
  // Launches bucket's graph (Replayable returned its record).
  cudaError_t Replay(int64_t bucket);
  // Starts capturing bucket's pass on the stream; its record (cleared), or
  // null when capture could not start (graphs are off from now on, said once).
  CallRecord* BeginCapture(int64_t bucket);
  // Ends the capture and instantiates the graph; on failure the caller
  // passes the error to CaptureFailed.
  cudaError_t EndCapture();
  const CallRecord& captured() const { return *capture_record_; }
  // Launches the graph EndCapture made.
  cudaError_t LaunchCaptured();
  // A failed capture: graphs off from now on (said once on stderr), the
  // pass fell back. INTERNAL saying why.
  absl::Status CaptureFailed(cudaError_t e);
  // The pass stopped: a capture in progress is dropped.
  void AbortCapture();
  void Drop();

  int64_t launches() const { return launches_; }
  int64_t captures() const { return captures_; }

 private:
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    CallRecord record;
  };
  bool on_;
  cudaStream_t stream_;
  std::map<int64_t, Graph> graphs_;  // by bucket
  bool capturing_ = false, replayed_ = false, fell_back_ = false;
  Graph* capture_ = nullptr;
  const CallRecord* capture_record_ = nullptr;
  int64_t launches_ = 0, captures_ = 0;
};

}  // namespace hmoe::cuda
