// hmoe-amx-microprobe's measurements (amx_microprobe.cc, the only file
// compiled with the AMX flags); main and its flags are in
// amx_microprobe_main.cc.
#pragma once

namespace hmoe::amx_probe {

enum class Mode {
  kSchedules,  // every schedule against the register-only loop
  kPairs,      // which logical CPUs share one AMX unit
  kRows,       // tile products over fewer than 16 rows
};

// Runs `mode` on 1 and `threads` threads (kPairs: on pairs of CPUs), `seconds`
// per case; the exit code (1 without XTILEDATA permission).
int Run(Mode mode, int threads, double seconds);

}  // namespace hmoe::amx_probe
