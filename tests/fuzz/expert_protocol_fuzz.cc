// The expert service's checks of what a worker sends. The first input byte
// picks the data plane:
//   even: gRPC: the rest is a hmoe.expert.v1.MoeRequest's wire bytes, turned
//         into a MoeCall as the service does and checked (ValidateMoeCall);
//   odd:  shared memory: the rest is a segment header's slot geometry and a
//         slot's request header, then the request region's bytes; checked
//         with CheckSlotGeometry / CheckSlotRequest and, if they pass,
//         ValidateMoeCall over arrays placed in that region.
// The shard is a small fixed one (2 MoE layers, 16 experts, top-4, H 64).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/transport/grpc_messages.h"
#include "common/transport/moe_call.h"
#include "common/transport/shm_layout.h"
#include "proto/expert.pb.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

const hmoe::ShardInfo& Info() {
  static const hmoe::ShardInfo* i = [] {
    auto* s = new hmoe::ShardInfo();
    s->model_type = "deepseek_v3";
    s->hidden = 64;
    s->intermediate = 32;
    s->num_experts = 16;
    s->top_k = 4;
    s->moe_layers = {1, 2};
    s->expert_begin = 0;
    s->expert_end = 16;
    s->i_begin = 0;
    s->i_end = 32;
    s->max_tokens = 64;
    s->weight_format = "bf16";
    return s;
  }();
  return *i;
}

void Grpc(const uint8_t* data, size_t size) {
  hmoe::expert::v1::MoeRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  (void)hmoe::expert::v1::OutputType_IsValid(req.output());
  (void)hmoe::ValidateMoeCall(Info(), hmoe::MoeCallOf(req));
}

void Shm(hmoe::fuzz::Input in) {
  hmoe::SlotGeometry g;
  g.num_slots = in.Take<uint32_t>();
  g.slots_offset = in.Take<uint64_t>();
  g.slot_bytes = in.Take<uint64_t>();
  g.req_capacity = in.Take<uint64_t>();
  g.resp_offset = in.Take<uint64_t>();
  g.resp_capacity = in.Take<uint64_t>();
  const uint64_t segment = in.Take<uint64_t>();
  hmoe::SlotRequest r;
  r.layer = in.Take<int32_t>();
  r.tokens = in.Take<int32_t>();
  r.top_k = in.Take<int32_t>();
  r.hidden_off = in.Take<uint64_t>();
  r.hidden_bytes = in.Take<uint64_t>();
  r.ids_off = in.Take<uint64_t>();
  r.ids_bytes = in.Take<uint64_t>();
  r.weights_off = in.Take<uint64_t>();
  r.weights_bytes = in.Take<uint64_t>();
  if (!hmoe::CheckSlotGeometry(g, segment).ok()) return;
  // The request region as the service sees it: the input's bytes, the rest
  // zero, capped so a large declared capacity stays cheap.
  if (g.req_capacity > (uint64_t{1} << 20)) g.req_capacity = uint64_t{1} << 20;
  std::vector<uint8_t> region(g.req_capacity, 0);
  if (!region.empty() && in.size() > 0)
    std::memcpy(region.data(), in.data(), std::min<size_t>(in.size(), region.size()));
  hmoe::MoeCall call;
  if (!hmoe::CheckSlotRequest(r, g, Info(), &call).ok()) return;
  // What passed lies inside the region: the service now reads ids and
  // weights (copied, aligned) and the hidden rows in place.
  std::vector<int32_t> ids(r.ids_bytes / 4);
  std::vector<float> weights(r.weights_bytes / 4);
  if (!ids.empty()) std::memcpy(ids.data(), region.data() + r.ids_off, ids.size() * 4);
  if (!weights.empty())
    std::memcpy(weights.data(), region.data() + r.weights_off, weights.size() * 4);
  call.hidden = reinterpret_cast<const uint16_t*>(region.data() + r.hidden_off);
  call.ids = ids.data();
  call.weights = weights.data();
  (void)hmoe::ValidateMoeCall(Info(), call);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1)
    Shm(hmoe::fuzz::Input(data + 1, size - 1));
  else
    Grpc(data + 1, size - 1);
  return 0;
}
