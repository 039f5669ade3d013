// `hmoe`: the hybridmoe command line.
//
//   hmoe inspect MODEL_DIR [--dram-gbps N] [--json] [--no-check]
//   hmoe convert MODEL_DIR OUT --format ...
//   hmoe generate -p TEXT | chat | bench-serve | stats   (against a running hmoe-gpu-worker)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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
      "      architecture, layer kinds, parameter counts, routed-expert bytes per format\n"
      "      and the decode ceiling for N GB/s of DRAM bandwidth (default 100)\n"
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
  std::vector<std::string> dirs;
  if (auto exit = fs.ParseOrExit(args, &dirs, [&]() -> absl::Status {
        if (dirs.size() > 1) return hmoe::UnexpectedArgument(dirs[1]);
        if (dirs.empty()) return absl::InvalidArgumentError("MODEL_DIR is required");
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
