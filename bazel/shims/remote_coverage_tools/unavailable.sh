#!/bin/sh
echo "bazel coverage is not supported offline (bazel/shims/remote_coverage_tools)" >&2
exit 1
