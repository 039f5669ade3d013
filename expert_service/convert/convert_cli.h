// `hmoe convert MODEL_DIR OUT [--format FORMAT] [--shards n --split tp|ep]`:
// writes packed expert files (packed_file.h) for hmoe-expert-service --packed-dir.
#pragma once

#include <string>
#include <vector>

namespace hmoe {

// args: everything after "convert". Returns the process exit status.
int ConvertCommand(const std::vector<std::string>& args);

}  // namespace hmoe
