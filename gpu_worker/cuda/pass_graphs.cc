#include "gpu_worker/cuda/pass_graphs.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"

namespace hmoe::cuda {

CallRecord* PassGraphs::Replayable(int64_t bucket) {
  if (!on_) return nullptr;
  auto it = graphs_.find(bucket);
  if (it == graphs_.end() || it->second.exec == nullptr) return nullptr;
  return &it->second.record;
}

cudaError_t PassGraphs::Replay(int64_t bucket) {
  cudaError_t e = cudaGraphLaunch(graphs_.at(bucket).exec, stream_);
  if (e != cudaSuccess) return e;
  ++launches_;
  replayed_ = true;
  return cudaSuccess;
}

CallRecord* PassGraphs::BeginCapture(int64_t bucket) {
  Graph& g = graphs_[bucket];
  g.record.Clear();
  cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    // Nothing captured yet: say why once, then run this pass eagerly
    // (CaptureFailed dropped the graphs, g with them).
    CaptureFailed(e).IgnoreError();
    fell_back_ = false;
    return nullptr;
  }
  capture_ = &g;
  capture_record_ = &g.record;
  capturing_ = true;
  return &g.record;
}

cudaError_t PassGraphs::EndCapture() {
  capturing_ = false;
  cudaGraph_t g = nullptr;
  cudaError_t e = cudaStreamEndCapture(stream_, &g);
  cudaGraphExec_t exec = nullptr;
  if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, g, 0);
  if (g != nullptr) cudaGraphDestroy(g);
  if (e != cudaSuccess) return e;
  capture_->exec = exec;
  return cudaSuccess;
}

cudaError_t PassGraphs::LaunchCaptured() {
  cudaGraphExec_t exec = capture_->exec;
  capture_ = nullptr;
  ++captures_;
  cudaError_t e = cudaGraphLaunch(exec, stream_);
  if (e != cudaSuccess) return e;
  ++launches_;
  return cudaSuccess;
}

absl::Status PassGraphs::CaptureFailed(cudaError_t e) {
  cudaGetLastError();  // a capture error is not sticky; do not leave it for a launcher
  on_ = false;
  fell_back_ = true;
  Drop();
  const std::string why = absl::StrCat("CUDA Graph capture failed: ", cudaGetErrorString(e));
  std::fprintf(stderr, "hmoe cuda backend: %s; passes run without graphs from now on\n",
               why.c_str());
  return absl::InternalError(why);
}

void PassGraphs::AbortCapture() {
  if (capturing_) {
    // Nothing ran: drop the half-captured graph.
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    capturing_ = false;
  }
  if (capture_ != nullptr) {
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
      if (&it->second == capture_) {
        graphs_.erase(it);
        break;
      }
    capture_ = nullptr;
  }
}

void PassGraphs::Drop() {
  for (auto& [bucket, g] : graphs_)
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
  capture_ = nullptr;
}

}  // namespace hmoe::cuda
