#!/usr/bin/env bash
# Fails when an ISA-flagged kernel object (kernels_{avx2,avx512,amx}.cc, built
# with -mavx2 / -mavx512* / -mamx-*) defines a weak or unique function. Such
# a function (an inline from a shared header, a std:: template) is one copy
# among several across the link, and the linker may keep this one for every
# caller: then code that runs before ISA dispatch would execute AVX-512 or
# AMX instructions and SIGILL on an older CPU.
# Usage: isa_objects_check.sh LIB.a [LIB.a ...]  (CMake: libhmoe_kernels.a;
# Bazel: the per-ISA libraries; their objects are kernels_amx.cc.o / kernels_amx.o)
set -euo pipefail
(($# > 0)) || { echo "usage: $0 libhmoe_kernels.a ..." >&2; exit 2; }
readelf -sW "$@" | awk '
  BEGIN { isa = "kernels_(avx2|avx512|amx)(\\.cc)?(\\.pic)?\\.o\\)$" }
  /^File: / { member = substr($0, 7); seen[member ~ isa] = 1; next }
  member ~ isa && $4 == "FUNC" &&
      ($5 == "WEAK" || $5 == "UNIQUE") { print member ": shared function " $8; bad = 1 }
  END {
    if (!seen[1]) { print "no ISA kernel objects in the archive"; exit 1 }
    exit bad
  }'
echo "ISA kernel objects define no shared functions"
