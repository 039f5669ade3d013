// The gRPC data plane's raw-buffer messages (common/transport/grpc_moe_wire.h)
// against protobuf's own encoding of the same messages, both ways, and what
// the decoder does with bytes that are not a MoeResponse.
#include "common/transport/grpc_moe_wire.h"

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "common/transport/grpc_messages.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {
namespace pb = ::hmoe::expert::v1;

std::string Flatten(const grpc::ByteBuffer& buf) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buf.Dump(&slices).ok());
  std::string s;
  for (const grpc::Slice& sl : slices)
    s.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return s;
}
grpc::ByteBuffer BufferOf(const std::string& bytes, size_t pieces = 1) {
  // `pieces` slices of about equal size, as a received message may be cut.
  std::vector<grpc::Slice> slices;
  const size_t step = bytes.empty() ? 1 : (bytes.size() + pieces - 1) / pieces;
  for (size_t at = 0; at < bytes.size(); at += step)
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(GrpcMoeWire, RequestIsProtobufsEncodingOfTheCall) {
  for (int tokens : {0, 1, 3, 129}) {
    const int top_k = 3, hidden = 40;
    std::vector<uint16_t> h(static_cast<size_t>(tokens) * hidden);
    std::iota(h.begin(), h.end(), uint16_t{7});
    std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k);
    std::iota(ids.begin(), ids.end(), -1);
    std::vector<float> w(ids.size(), 0.25f);
    const MoeCall call = MoeCall::Make(5, tokens, top_k, hidden, h.data(), ids.data(), w.data());
    const grpc::ByteBuffer buf = EncodeMoeRequest(uint64_t{1} << 40, call);
    pb::MoeRequest got;
    ASSERT_TRUE(got.ParseFromString(Flatten(buf))) << tokens;
    pb::MoeRequest want;
    ToMoeRequest(call, &want);
    want.set_request_id(uint64_t{1} << 40);
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString()) << tokens;
    EXPECT_EQ(MoeCallOf(got).hidden_bytes, h.size() * 2);
  }
}

pb::MoeResponse Head(uint64_t id, int code) {
  pb::MoeResponse r;
  r.set_request_id(id);
  r.set_code(code);
  r.set_message(code ? "refused" : "");
  r.set_tokens(2);
  r.set_hidden(3);
  r.set_compute_ns(99);
  return r;
}

// What the service sends (head + `out` slice) and what protobuf itself
// writes both decode to the same head, `out` into the sink's buffer, also
// when the received bytes arrive cut into many slices.
TEST(GrpcMoeWire, ResponseDecodesOursAndProtobufsEncoding) {
  std::vector<float> values(6);
  std::iota(values.begin(), values.end(), 1.5f);
  const grpc::Slice out(values.data(), values.size() * 4);
  const pb::MoeResponse head = Head(42, 0);
  pb::MoeResponse full = head;
  full.set_out(values.data(), values.size() * 4);
  const std::string ours = Flatten(EncodeMoeResponse(head, out));
  pb::MoeResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(ours));
  EXPECT_EQ(parsed.SerializeAsString(), full.SerializeAsString());
  for (const std::string& bytes : {ours, full.SerializeAsString()}) {
    for (size_t pieces : {1, 2, 5, 17}) {
      grpc::ByteBuffer buf = BufferOf(bytes, pieces);
      std::vector<float> dst(6, -1.f);
      uint64_t seen_id = 0, got = 7;
      pb::MoeResponse h;
      const absl::Status st =
          DecodeMoeResponse(&buf, &h, &got, [&](const pb::MoeResponse& so_far, uint64_t n) {
            seen_id = so_far.request_id();
            EXPECT_EQ(n, 24u);
            return static_cast<void*>(dst.data());
          });
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(seen_id, 42u);
      EXPECT_EQ(got, 24u);
      EXPECT_EQ(dst, values) << pieces;
      EXPECT_TRUE(h.out().empty());
      EXPECT_EQ(h.compute_ns(), 99u);
      EXPECT_EQ(h.tokens(), 2);
      EXPECT_TRUE(MoeResponseStatus(h, got, 24).ok());
      EXPECT_EQ(MoeResponseStatus(h, got, 28).code(), absl::StatusCode::kDataLoss);
    }
  }
}

TEST(GrpcMoeWire, DroppedOutAndAnswersWithoutOut) {
  std::vector<float> values(4, 2.f);
  grpc::ByteBuffer buf = EncodeMoeResponse(Head(3, 0), grpc::Slice(values.data(), 16));
  pb::MoeResponse h;
  uint64_t got = 0;
  ASSERT_TRUE(DecodeMoeResponse(&buf, &h, &got, [](const pb::MoeResponse&, uint64_t) {
                return static_cast<void*>(nullptr);
              }).ok());
  EXPECT_EQ(got, 16u);
  EXPECT_EQ(h.request_id(), 3u);
  // A refusal has no `out`: the sink is never asked.
  buf = EncodeMoeResponse(Head(4, 3), grpc::Slice());
  bool asked = false;
  ASSERT_TRUE(DecodeMoeResponse(&buf, &h, &got, [&](const pb::MoeResponse&, uint64_t) {
                asked = true;
                return static_cast<void*>(nullptr);
              }).ok());
  EXPECT_FALSE(asked);
  EXPECT_EQ(got, 0u);
  EXPECT_EQ(h.code(), 3);
  EXPECT_EQ(h.message(), "refused");
  EXPECT_EQ(MoeResponseStatus(h, got, 16).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GrpcMoeWire, BytesThatAreNotAResponseAreDataLoss) {
  std::vector<float> values(8, 1.f);
  const std::string good = Flatten(EncodeMoeResponse(Head(9, 0), grpc::Slice(values.data(), 32)));
  pb::MoeResponse bad_utf8 = Head(9, 0);
  bad_utf8.set_message("x");
  std::string utf8 = bad_utf8.SerializeAsString();
  utf8[utf8.find('x')] = '\xff';
  pb::MoeResponse twice;
  twice.set_out("ab");
  const std::string two_outs = twice.SerializeAsString() + twice.SerializeAsString();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"cut inside out", good.substr(0, good.size() - 5)},
      {"cut inside the head", good.substr(0, 3)},
      {"tag 0", std::string("\0\0", 2)},
      {"bad wire type", std::string("\x0f\x01", 2)},
      {"message not UTF-8", utf8},
      {"two outs", two_outs},
  };
  for (const auto& [name, bytes] : cases) {
    grpc::ByteBuffer buf = BufferOf(bytes, 2);
    std::vector<float> dst(8);
    pb::MoeResponse h;
    uint64_t got = 0;
    const absl::Status st = DecodeMoeResponse(
        &buf, &h, &got,
        [&](const pb::MoeResponse&, uint64_t) { return static_cast<void*>(dst.data()); });
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << name;
    EXPECT_NE(st.message().find("is not a hmoe.expert.v1.MoeResponse"), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace hmoe
