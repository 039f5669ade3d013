#include "common/transport/grpc_moe_wire.h"

#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "proto/expert.grpc.pb.h"

namespace hmoe {
namespace pb = ::hmoe::expert::v1;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

namespace {
// Field numbers of the two large fields (proto/expert.proto).
constexpr int kRequestHidden = pb::MoeRequest::kHiddenFieldNumber;
constexpr int kResponseOut = pb::MoeResponse::kOutFieldNumber;

uint32_t BytesTag(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}
size_t BytesFieldHeaderSize(int field, uint64_t n) {
  return CodedOutputStream::VarintSize32(BytesTag(field)) + CodedOutputStream::VarintSize64(n);
}
uint8_t* WriteBytesFieldHeader(int field, uint64_t n, uint8_t* p) {
  p = CodedOutputStream::WriteVarint32ToArray(BytesTag(field), p);
  return CodedOutputStream::WriteVarint64ToArray(n, p);
}
// Where a new slice's bytes start, to write them. A small slice keeps its
// bytes inside the object: write them before the slice is copied or moved.
uint8_t* Bytes(grpc::Slice& s) { return const_cast<uint8_t*>(s.begin()); }
}  // namespace

const char* MoeMethodName() {
  static const std::string* name =
      new std::string(absl::StrCat("/", pb::ExpertData::service_full_name(), "/Moe"));
  return name->c_str();
}

grpc::ByteBuffer EncodeMoeRequest(uint64_t request_id, const MoeCall& call) {
  // The small fields through protobuf; the activations appended as field 5
  // (protobuf takes fields in any order).
  pb::MoeRequest head;
  head.set_request_id(request_id);
  head.set_layer(call.layer);
  head.set_tokens(call.tokens);
  head.set_top_k(call.top_k);
  head.set_expert_ids(call.ids, call.ids_bytes);
  head.set_expert_weights(call.weights, call.weights_bytes);
  const size_t head_bytes = head.ByteSizeLong();
  const uint64_t n = call.hidden_bytes;
  grpc::Slice slice(head_bytes + BytesFieldHeaderSize(kRequestHidden, n) + n);
  uint8_t* p = head.SerializeWithCachedSizesToArray(Bytes(slice));
  p = WriteBytesFieldHeader(kRequestHidden, n, p);
  if (n > 0) std::memcpy(p, call.hidden, n);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeMoeResponse(const pb::MoeResponse& head, const grpc::Slice& out) {
  const size_t head_bytes = head.ByteSizeLong();
  const size_t n = out.size();
  grpc::Slice first(head_bytes + (n > 0 ? BytesFieldHeaderSize(kResponseOut, n) : 0));
  uint8_t* p = head.SerializeWithCachedSizesToArray(Bytes(first));
  if (n == 0) return grpc::ByteBuffer(&first, 1);  // proto3 leaves an empty field out
  WriteBytesFieldHeader(kResponseOut, n, p);
  const grpc::Slice slices[2] = {first, out};
  return grpc::ByteBuffer(slices, 2);
}

absl::Status DecodeMoeResponse(grpc::ByteBuffer* buf, pb::MoeResponse* head, uint64_t* out_bytes,
                               const MoeOutSink& sink) {
  head->Clear();
  *out_bytes = 0;
  const size_t total = buf->Length();
  auto bad = [&](const char* what) {
    return absl::DataLossError(absl::StrCat("expert service (grpc): an answer of ", total,
                                            " bytes is not a hmoe.expert.v1.MoeResponse (", what,
                                            ")"));
  };
  if (total > static_cast<size_t>(std::numeric_limits<int>::max())) return bad("over 2 GiB");
  // Every field but `out`, re-encoded as read, then parsed by protobuf: its
  // own checks (UTF-8 of `message`, varint ranges) apply to them.
  std::string rest;
  grpc::ProtoBufferReader reader(buf);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  bool seen_out = false;
  {
    google::protobuf::io::StringOutputStream rest_stream(&rest);
    CodedOutputStream rest_out(&rest_stream);
    while (const uint32_t tag = in.ReadTag()) {
      if (tag != BytesTag(kResponseOut)) {
        if (!WireFormatLite::SkipField(&in, tag, &rest_out)) return bad("a field does not parse");
        continue;
      }
      uint32_t n = 0;
      if (!in.ReadVarint32(&n)) return bad("the length of `out` does not parse");
      if (seen_out) return bad("two `out` fields");
      seen_out = true;
      rest_out.Trim();
      if (!head->ParseFromString(rest)) return bad("the fields before `out` do not parse");
      void* dst = sink(*head, n);
      if (!(dst != nullptr ? in.ReadRaw(dst, static_cast<int>(n)) : in.Skip(static_cast<int>(n))))
        return bad("`out` is cut short");
      *out_bytes = n;
    }
    if (!in.ConsumedEntireMessage()) return bad("a tag does not parse");
  }
  if (!head->ParseFromString(rest)) return bad("its fields do not parse");
  return absl::OkStatus();
}

}  // namespace hmoe
