#include "gpu_worker/model.h"

#include <cstdio>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/runtime/thread_pool.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "gpu_worker/cpu/cpu_backend.h"
#include "gpu_worker/cpu/reference_experts.h"
#include "gpu_worker/driver/model_driver.h"
#ifdef HMOE_HAVE_CUDA
#include "gpu_worker/cuda/cuda_backend.h"
#endif

namespace hmoe {

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir,
                                                   const ModelOptions& options,
                                                   RoutedExperts* experts) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  if (options.load_progress == nullptr) {
    ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
    return Create(config, *ckpt, options, experts);
  }
  // Progress: the bytes of every tensor the model takes but the routed
  // experts (the hot and streamed copies report their own), each counted once
  // when a backend first takes it.
  struct Taken {
    std::unordered_set<std::string> names;  // fixed before the first Get
    std::mutex mu;
    std::unordered_set<std::string> counted;
  };
  auto taken = std::make_shared<Taken>();
  for (const WeightSpec& w : ExpectedWeights(config)) {
    if (w.role == WeightRole::kRoutedExpert) continue;
    taken->names.insert(w.name);
    if (w.matrix()) taken->names.insert(ScaleInvName(w.name));
  }
  LoadProgressOptions po = *options.load_progress;
  po.what = "loading weights";
  LoadProgressReporter progress(std::move(po));
  SafetensorsOptions so;
  so.on_get = [taken, &progress](const TensorEntry& e) {
    if (!taken->names.count(e.name)) return;
    {
      std::lock_guard<std::mutex> lock(taken->mu);
      if (!taken->counted.insert(e.name).second) return;
    }
    progress.Add(static_cast<int64_t>(e.end - e.begin));
  };
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir, so));
  int64_t total = 0;
  for (const std::string& name : taken->names)
    if (const TensorEntry* e = ckpt->Find(name)) total += static_cast<int64_t>(e->end - e->begin);
  progress.SetTotal(total);
  absl::StatusOr<std::unique_ptr<Model>> model = Create(config, *ckpt, options, experts);
  progress.Finish();
  return model;
}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelConfig& config,
                                                     const Checkpoint& ckpt,
                                                     const ModelOptions& options,
                                                     RoutedExperts* experts) {
  if (options.num_threads < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.num_threads must be >= 0, got ", options.num_threads));
  if (options.max_seq_len < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.max_seq_len must be >= 0, got ", options.max_seq_len));
  if (options.deferred_experts != 0 &&
      (options.deferred_experts < 0 || config.moe.experts_per_token <= 0 ||
       options.deferred_experts >= config.moe.experts_per_token))
    return absl::InvalidArgumentError(absl::StrCat(
        "ModelOptions.deferred_experts must be 0 or in [1, ", config.moe.experts_per_token - 1,
        "] (experts_per_token ", config.moe.experts_per_token, " of ", config.model_type, "), got ",
        options.deferred_experts));
  if (options.cuda.gpu_mem_gb < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.cuda.gpu_mem_gb must be >= 0, got ", options.cuda.gpu_mem_gb));
  if (options.cuda.kv_blocks < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.cuda.kv_blocks must be >= 0, got ", options.cuda.kv_blocks));
  if (static_cast<int64_t>(config.layers.size()) != config.num_layers)
    return absl::InvalidArgumentError("ModelConfig.layers does not match num_hidden_layers");
  if (config.quantization.method == "fp8" &&
      config.quantization.weight_block[0] != config.quantization.weight_block[1])
    return absl::UnimplementedError(absl::StrCat(
        ckpt.dir(), ": fp8 weight blocks must be square, got ", config.quantization.weight_block[0],
        "x", config.quantization.weight_block[1]));
  ModelOptions o = options;
  ASSIGN_OR_RETURN(o.backend, ResolveBackend(options.backend, options.cuda.device));
  if (o.num_threads == 0)
    o.num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.max_seq_len == 0) o.max_seq_len = config.max_position_embeddings;
  // With experts served elsewhere the checkpoint need not hold them.
  RETURN_IF_ERROR(CheckWeights(config, ckpt, /*routed_experts=*/experts == nullptr));
  // The CPU's parallel loops: the cpu backend's and the in-process experts'.
  std::shared_ptr<ThreadPool> pool;
  if (o.backend == "cpu" || (config.num_moe_layers() > 0 && experts == nullptr)) {
    ASSIGN_OR_RETURN(pool, ThreadPool::Create(UnpinnedThreads(o.num_threads)));
  }
  std::unique_ptr<RoutedExperts> owned;
  if (config.num_moe_layers() > 0 && experts == nullptr) {
    ASSIGN_OR_RETURN(auto ref, cpu::ReferenceExperts::Create(config, ckpt, pool));
    owned = std::move(ref);
    experts = owned.get();
  }
  std::unique_ptr<LayerBackend> backend;
  if (o.backend == "cuda") {
#ifdef HMOE_HAVE_CUDA
    ASSIGN_OR_RETURN(backend, cuda::CreateCudaBackend(config, ckpt, o));
#endif
  } else {
    ASSIGN_OR_RETURN(backend, cpu::CreateCpuBackend(config, ckpt, o, pool));
  }
  return CreateModelDriver(config, o, std::move(backend), experts, std::move(owned));
}

std::string_view PrefillExpertsName(PrefillExperts p) {
  switch (p) {
    case PrefillExperts::kCpu:
      return "cpu";
    case PrefillExperts::kStream:
      return "stream";
    case PrefillExperts::kAuto:
      return "auto";
  }
  return "cpu";
}

std::optional<PrefillExperts> ParsePrefillExperts(std::string_view s) {
  if (s == "cpu") return PrefillExperts::kCpu;
  if (s == "stream") return PrefillExperts::kStream;
  if (s == "auto") return PrefillExperts::kAuto;
  return std::nullopt;
}

absl::StatusOr<std::string> ResolveBackend(const std::string& name, int cuda_device) {
  if (name == "cpu") return name;
  if (name != "cuda" && name != "auto")
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.backend must be cpu, cuda or auto, got \"", name, "\""));
#ifdef HMOE_HAVE_CUDA
  std::string why;
  if (cuda::CudaBackendUsable(cuda_device, &why)) return std::string("cuda");
  if (name == "auto") return std::string("cpu");
  return absl::FailedPreconditionError(absl::StrCat("backend cuda: ", why));
#else
  (void)cuda_device;
  if (name == "auto") return std::string("cpu");
  return absl::UnimplementedError("backend cuda: this build has no CUDA (built without nvcc)");
#endif
}

absl::StatusOr<DeviceMemory> QueryDeviceMemory(int cuda_device) {
#ifdef HMOE_HAVE_CUDA
  int64_t used = 0, total = 0;
  std::string why;
  if (!cuda::DeviceMemoryInfo(cuda_device, &used, &total, &why))
    return absl::FailedPreconditionError(why);
  return DeviceMemory{used, total};
#else
  (void)cuda_device;
  return absl::UnimplementedError("GPU memory: this build has no CUDA (built without nvcc)");
#endif
}

absl::Status Model::Forward(Sequence& seq, absl::Span<const int32_t> tokens, LogitsMode mode,
                            std::vector<float>* logits) const {
  const ForwardStep step{&seq, tokens, mode, logits};
  return ForwardBatch(absl::MakeConstSpan(&step, 1));
}

absl::StatusOr<std::vector<float>> Model::Prefill(Sequence& seq, absl::Span<const int32_t> tokens,
                                                  LogitsMode mode) const {
  std::vector<float> logits;
  RETURN_IF_ERROR(Forward(seq, tokens, mode, &logits));
  return logits;
}

absl::StatusOr<std::vector<float>> Model::Decode(Sequence& seq, int32_t token) const {
  std::vector<float> logits;
  RETURN_IF_ERROR(Forward(seq, absl::MakeConstSpan(&token, 1), LogitsMode::kLast, &logits));
  return logits;
}

}  // namespace hmoe
