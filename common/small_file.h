// Reading the small files a model directory and the command lines name
// (config.json, tokenizer.json, chat templates, JSON indexes, credentials):
// regular files only, of a bounded size, without blocking and without
// exceptions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hmoe {

// Caps on what ReadSmallFile is asked to take for each kind of file.
inline constexpr int64_t kMaxConfigJsonBytes = 16ll << 20;      // config.json & co
inline constexpr int64_t kMaxTokenizerJsonBytes = 512ll << 20;  // tokenizer.json
inline constexpr int64_t kMaxChatTemplateBytes = 16ll << 20;    // *.jinja
inline constexpr int64_t kMaxIndexJsonBytes = 256ll << 20;      // *.index.json, rates

// The bytes of `path`, a regular file (symlinks followed) of at most
// `max_bytes`. `what` begins every error message (default: the path). The
// open never blocks (a FIFO or a device is refused, not waited on) and
// nothing throws. NOT_FOUND when there is no such file; PERMISSION_DENIED
// when it cannot be opened for reading; FAILED_PRECONDITION when it is not a
// regular file or names a symlink loop; INVALID_ARGUMENT when it is larger
// than `max_bytes`; INTERNAL on a read error. `*mode` (if given) gets its
// permission bits.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t max_bytes,
                                          absl::string_view what = {}, uint32_t* mode = nullptr);

}  // namespace hmoe
