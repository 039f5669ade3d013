// `hmoe` subcommands that talk to a running hmoe-gpu-worker.
//   generate -p TEXT   stream a completion, print tok/s
//   chat               interactive, keeps the conversation
//   bench-serve        N concurrent clients: latency percentiles and throughput
//   bench-agent        replays a coding agent's turns: time to first token per turn
// Each takes the arguments after its name and returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace hmoe {

int GenerateCommand(const std::vector<std::string>& args);
int ChatCommand(const std::vector<std::string>& args);
int BenchServeCommand(const std::vector<std::string>& args);
int BenchAgentCommand(const std::vector<std::string>& args);
// Streaming chat tok/s at batch 1 through the HTTP API beside the gRPC API
// on the same worker and conversation (requests alternate).
int BenchHttpCommand(const std::vector<std::string>& args);
// hmoe stats [--save FILE] [--json]: the worker's engine and routing
// statistics; --save writes the routing table (common/routing_stats.h).
int StatsCommand(const std::vector<std::string>& args);

}  // namespace hmoe
