// `hmoe`: the hybridmoe command line.
//
//   hmoe inspect MODEL_DIR [--dram-gbps N] [--json] [--no-check]
//                [--gpu-mem-gb X --context N --batch B --gpu-weights F --kv-dtype D]
//   hmoe convert MODEL_DIR OUT --format ...
//   hmoe generate -p TEXT | chat | bench-serve | stats   (against a running hmoe-gpu-worker)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/experts/weight_format.h"
#include "common/flags.h"
#include "expert_service/convert/convert_cli.h"
#include "sdk/commands.h"
#include "sdk/inspect.h"

namespace {

int Usage(FILE* out) {
  std::fprintf(
      out,
      "usage: hmoe COMMAND ...\n\n"
      "commands:\n"
      "  inspect MODEL_DIR [--dram-gbps N] [--json] [--no-check]\n"
      "                   [--gpu-mem-gb X [--context N] [--batch B] [--gpu-weights F]\n"
      "                   [--kv-dtype D] [--host-embedding] [--fill-hot FORMAT]]\n"
      "      architecture, layer kinds, parameter counts, routed-expert bytes per format\n"
      "      and the decode ceiling for N GB/s of DRAM bandwidth (default 100); with\n"
      "      --gpu-mem-gb the CUDA worker's GPU memory plan: what fits, or the smallest change\n"
      "  convert MODEL_DIR OUT [--format FORMAT] [--shards n --split tp|ep]\n"
      "      packed expert files for hmoe-expert-service --packed-dir\n"
      "  generate -p|--prompt TEXT [--server ADDR] [sampling flags] [--ids] [--timeout SEC]\n"
      "      stream a completion from hmoe-gpu-worker and print tok/s\n"
      "  chat [--server ADDR] [--system TEXT] [--plain-text] [sampling flags]\n"
      "      interactive chat that keeps the conversation (the model's chat template\n"
      "      on the worker; --plain-text or no template: a User:/Assistant: transcript)\n"
      "  bench-serve [--server ADDR] [--clients N] [--requests M] [--max-tokens K] [-p TEXT]\n"
      "              [--retry N]  (exit 1 when any request is refused or fails)\n"
      "      N concurrent clients: latency percentiles and throughput\n"
      "  bench-agent [--server ADDR] [--turns N] [--system-words W] [--turn-words W] [--tools N]\n"
      "              [--max-tokens K] [--label TEXT] [--json FILE]\n"
      "      replays a coding agent's conversation: time to first token per turn\n"
      "  bench-http [--server ADDR] [--http URL] [--requests N] [--max-tokens K] [-p TEXT]\n"
      "      streaming chat tok/s at batch 1 over the HTTP API beside gRPC (alternating)\n"
      "  stats [--server ADDR] [--save FILE] [--json]\n"
      "      the worker's requests, KV use and tokens routed per layer and expert;\n"
      "      --save writes the routing table as JSON (for hot-expert placement)\n"
      "hmoe COMMAND --help lists its flags (sampling flags: --max-tokens N --temperature T\n"
      "  --top-k K --top-p P --min-p P --repetition-penalty R --presence-penalty X\n"
      "  --frequency-penalty X --seed S --stop STR (repeatable) --ignore-eos[=true|false]\n"
      "  --add-special-tokens[=true|false])\n"
      "(--server defaults to $HMOE_SERVER or 127.0.0.1:50051; --token-file, default\n"
      " $HMOE_TOKEN_FILE, names the file with the worker's --auth-token-file token;\n"
      " --tls-ca-file, default $HMOE_TLS_CA_FILE, turns on TLS and verifies the worker with\n"
      " that CA; --tls-cert-file / --tls-key-file give a client certificate)\n");
  return out == stderr ? 2 : 0;
}

int Inspect(const std::vector<std::string>& args) {
  hmoe::InspectOptions opt;
  hmoe::FlagSet fs("hmoe inspect", "MODEL_DIR [flags]",
                   "Architecture, layer kinds, parameter counts, routed-expert bytes per format\n"
                   "and the decode ceiling for the DRAM bandwidth given.");
  fs.Double(
      "dram-gbps", &opt.dram_gbps, "GB/s of DRAM bandwidth for the decode ceiling",
      [](double x) { return x > 0; }, "a positive number");
  fs.Bool("json", &opt.json, "the report as JSON");
  fs.Bool("check", &opt.check_weights, "open the checkpoint (if any) and check the weight map");
  fs.Group("GPU memory plan (the CUDA worker's; gpu_worker/memory_plan.h)");
  hmoe::PlanRequest& plan = opt.plan;
  fs.Double(
      "gpu-mem-gb", &plan.gpu_mem_gb, "the GPU memory bound in GiB: prints the plan for it",
      [](double x) { return x > 0 && x <= 1e6; }, "a number of GiB > 0");
  fs.Int("context", &plan.context, 1, int64_t{1} << 24,
         "tokens per sequence (the worker's --max-context); default: max_position_embeddings");
  fs.Int("batch", &plan.batch, 1, 4096, "sequences of --context tokens (the worker's --max-batch)");
  fs.Enum<hmoe::DenseWeights>("gpu-weights", &plan.weights,
                              {{"auto", hmoe::DenseWeights::kAuto},
                               {"bf16", hmoe::DenseWeights::kBf16},
                               {"fp8", hmoe::DenseWeights::kFp8},
                               {"int8", hmoe::DenseWeights::kInt8},
                               {"int4", hmoe::DenseWeights::kInt4}},
                              "precision of attention, dense MLPs, shared experts and the LM head "
                              "(auto: the checkpoint's own, lowered bf16 -> fp8 -> int4 only as "
                              "far as needed)");
  fs.Enum<hmoe::KvDtype>(
      "kv-dtype", &plan.kv_dtype,
      {{"f32", hmoe::KvDtype::kF32}, {"bf16", hmoe::KvDtype::kBf16}, {"fp8", hmoe::KvDtype::kFp8}},
      "element type of the KV cache");
  fs.Bool("host-embedding", &plan.host_embedding,
          "the embedding may stay in host memory when the plan needs the room");
  std::string fill_hot;
  fs.String("fill-hot", &fill_hot, "FORMAT",
            "how many hot experts in FORMAT (e.g. int4, int4g64) fit in what is left");
  fs.Int("pass-tokens", &plan.pass_tokens, 1, int64_t{1} << 20,
         "the largest pass the workspace is planned for");
  std::vector<std::string> dirs;
  if (auto exit = fs.ParseOrExit(args, &dirs, [&]() -> absl::Status {
        if (dirs.size() > 1) return hmoe::UnexpectedArgument(dirs[1]);
        if (dirs.empty()) return absl::InvalidArgumentError("MODEL_DIR is required");
        if (!fill_hot.empty()) {
          auto f = hmoe::ParseFormatFlag(fill_hot, 64);
          if (!f.ok())
            return absl::InvalidArgumentError(absl::StrCat("--fill-hot: ", f.status().message()));
          plan.fill_hot_experts = true;
          plan.hot_format = f->first;
          plan.hot_group = f->second;
        }
        for (const char* flag : {"context", "batch", "gpu-weights", "kv-dtype", "host-embedding",
                                 "fill-hot", "pass-tokens"})
          if (fs.seen(flag) && !fs.seen("gpu-mem-gb"))
            return absl::InvalidArgumentError(
                absl::StrCat("--", flag, " is a GPU memory plan flag: it needs --gpu-mem-gb"));
        return absl::OkStatus();
      }))
    return *exit;
  const std::string& dir = dirs[0];
  auto report = hmoe::InspectModel(dir, opt);
  if (!report.ok()) {
    std::fprintf(stderr, "hmoe inspect: %s\n", std::string(report.status().ToString()).c_str());
    return 1;
  }
  std::fputs(hmoe::FormatReport(*report, opt).c_str(), stdout);
  return report->weight_check.empty() || report->weight_check == "ok" ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage(stderr);
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "inspect") return Inspect(args);
  if (cmd == "convert") return hmoe::ConvertCommand(args);
  if (cmd == "generate") return hmoe::GenerateCommand(args);
  if (cmd == "chat") return hmoe::ChatCommand(args);
  if (cmd == "bench-serve") return hmoe::BenchServeCommand(args);
  if (cmd == "bench-agent") return hmoe::BenchAgentCommand(args);
  if (cmd == "bench-http") return hmoe::BenchHttpCommand(args);
  if (cmd == "stats") return hmoe::StatsCommand(args);
  if (cmd == "-h" || cmd == "--help" || cmd == "help") return Usage(stdout);
  std::fprintf(stderr, "hmoe: unknown command \"%s\"\n", cmd.c_str());
  return Usage(stderr);
}
