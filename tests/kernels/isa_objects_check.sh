#!/usr/bin/env bash
# Fails when an ISA-flagged kernel object (kernels_{avx2,avx512,amx}.cc, built
# with -mavx2 / -mavx512* / -mamx-*) defines a weak or unique function. Such
# a function (an inline from a shared header, a std:: template) is one copy
# among several across the link, and the linker may keep this one for every
# caller: then code that runs before ISA dispatch would execute AVX-512 or
# AMX instructions and SIGILL on an older CPU. Usage: isa_objects_check.sh LIB.a
set -euo pipefail
lib=${1:?usage: $0 libhmoe_kernels.a}
readelf -sW "$lib" | awk '
  /^File: / { member = substr($0, 7); seen[member ~ /kernels_(avx2|avx512|amx)\.cc\.o\)$/] = 1; next }
  member ~ /kernels_(avx2|avx512|amx)\.cc\.o\)$/ && $4 == "FUNC" &&
      ($5 == "WEAK" || $5 == "UNIQUE") { print member ": shared function " $8; bad = 1 }
  END {
    if (!seen[1]) { print "no ISA kernel objects in the archive"; exit 1 }
    exit bad
  }'
echo "ISA kernel objects define no shared functions"
