// The gRPC data plane's messages (hmoe.expert.v1.MoeRequest / MoeResponse)
// as raw byte buffers, so that the large fields are copied once or not at
// all: a request's activations go from the caller's buffer into the one
// slice gRPC sends; an answer's `out` rides in the slice the service
// computed into and is read from the received slices straight into the
// caller's output. The bytes are the messages' ordinary protobuf encoding:
// either end may be any other protobuf implementation.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "common/transport/moe_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/expert.pb.h"

namespace hmoe {

// The full method name of ExpertData/Moe: "/hmoe.expert.v1.ExpertData/Moe".
const char* MoeMethodName();

// A MoeRequest carrying `call` (output OUTPUT_F32) as one slice: the call's
// buffers are copied once, into it.
grpc::ByteBuffer EncodeMoeRequest(uint64_t request_id, const MoeCall& call);

// A MoeResponse of `head`'s fields (whose `out` must be empty) and `out` as
// its `out` field, which is not copied (the buffer keeps a reference).
grpc::ByteBuffer EncodeMoeResponse(const expert::v1::MoeResponse& head, const grpc::Slice& out);

// Where the `out` field's `bytes` go once the fields before it are known
// (`head`: in the usual field order request_id, code, message, tokens,
// hidden and output): a buffer of at least `bytes`, or nullptr to drop them.
using MoeOutSink = std::function<void*(const expert::v1::MoeResponse& head, uint64_t bytes)>;

// Reads a MoeResponse from `buf` (consumed): every field but `out` into
// *head (its `out` stays empty), `out`'s bytes to where `sink` says, their
// count into *out_bytes (0 when absent). DATA_LOSS when the bytes are not a
// MoeResponse; the sink's buffer may then hold part of `out`.
absl::Status DecodeMoeResponse(grpc::ByteBuffer* buf, expert::v1::MoeResponse* head,
                               uint64_t* out_bytes, const MoeOutSink& sink);

}  // namespace hmoe
