#include "common/transport/grpc_messages.h"

#include "absl/strings/str_cat.h"
#include "proto/expert.pb.h"

namespace hmoe {
namespace pb = ::hmoe::expert::v1;

void ToShardDescription(const ShardInfo& i, expert::v1::ShardDescription* d) {
  d->set_model_type(i.model_type);
  d->set_hidden(i.hidden);
  d->set_intermediate(i.intermediate);
  d->set_num_experts(i.num_experts);
  d->set_top_k(i.top_k);
  for (int32_t l : i.moe_layers) d->add_moe_layers(l);
  d->set_shard_index(i.shard_index);
  d->set_num_shards(i.num_shards);
  d->set_split(i.split == SplitMode::kEp ? pb::SPLIT_EP : pb::SPLIT_TP);
  d->set_expert_begin(i.expert_begin);
  d->set_expert_end(i.expert_end);
  d->set_i_begin(i.i_begin);
  d->set_i_end(i.i_end);
  d->set_max_tokens(i.max_tokens);
  d->set_weight_format(i.weight_format);
  d->set_conversion_id(i.conversion_id);
  d->set_source_fingerprint(i.source_fingerprint);
  d->set_pid(i.pid);
  d->set_shm_available(i.shm_available);
  d->set_ucx_available(i.ucx_available);
}

absl::StatusOr<ShardInfo> FromShardDescription(const expert::v1::ShardDescription& d) {
  if (!pb::SplitMode_IsValid(d.split()))
    return absl::DataLossError(absl::StrCat("expert service: ShardDescription.split = ", d.split(),
                                            " is not a SplitMode (0 SPLIT_TP, 1 SPLIT_EP)"));
  ShardInfo info;
  info.model_type = d.model_type();
  info.hidden = d.hidden();
  info.intermediate = d.intermediate();
  info.num_experts = d.num_experts();
  info.top_k = d.top_k();
  info.moe_layers.assign(d.moe_layers().begin(), d.moe_layers().end());
  info.shard_index = d.shard_index();
  info.num_shards = d.num_shards();
  info.split = d.split() == pb::SPLIT_EP ? SplitMode::kEp : SplitMode::kTp;
  info.expert_begin = d.expert_begin();
  info.expert_end = d.expert_end();
  info.i_begin = d.i_begin();
  info.i_end = d.i_end();
  info.max_tokens = d.max_tokens();
  info.weight_format = d.weight_format();
  info.conversion_id = d.conversion_id();
  info.source_fingerprint = d.source_fingerprint();
  info.pid = d.pid();
  info.shm_available = d.shm_available();
  info.ucx_available = d.ucx_available();
  return info;
}

MoeCall MoeCallOf(const expert::v1::MoeRequest& req) {
  MoeCall call;
  call.layer = req.layer();
  call.tokens = req.tokens();
  call.top_k = req.top_k();
  call.hidden = reinterpret_cast<const uint16_t*>(req.hidden().data());
  call.hidden_bytes = req.hidden().size();
  call.ids = reinterpret_cast<const int32_t*>(req.expert_ids().data());
  call.ids_bytes = req.expert_ids().size();
  call.weights = reinterpret_cast<const float*>(req.expert_weights().data());
  call.weights_bytes = req.expert_weights().size();
  return call;
}

void ToMoeRequest(const MoeCall& call, expert::v1::MoeRequest* req) {
  req->set_layer(call.layer);
  req->set_tokens(call.tokens);
  req->set_top_k(call.top_k);
  req->set_hidden(call.hidden, call.hidden_bytes);
  req->set_expert_ids(call.ids, call.ids_bytes);
  req->set_expert_weights(call.weights, call.weights_bytes);
}

absl::Status MoeResponseStatus(const expert::v1::MoeResponse& resp, int64_t out_bytes) {
  return MoeResponseStatus(resp, resp.out().size(), out_bytes);
}

absl::Status MoeResponseStatus(const expert::v1::MoeResponse& resp, uint64_t got_bytes,
                               int64_t out_bytes) {
  if (resp.code() < 0 || resp.code() > 16)
    return absl::UnknownError(absl::StrCat("expert service: MoeResponse.code = ", resp.code(),
                                           " is not a status code (message: ", resp.message(),
                                           ")"));
  if (resp.code() != 0)
    return absl::Status(static_cast<absl::StatusCode>(resp.code()), resp.message());
  if (resp.output() != pb::OUTPUT_F32)
    return absl::DataLossError(absl::StrCat("expert service: MoeResponse.output = ", resp.output(),
                                            ", asked for OUTPUT_F32"));
  if (got_bytes != static_cast<uint64_t>(out_bytes))
    return absl::DataLossError(
        absl::StrCat("expert service: response of ", got_bytes, " bytes, expected ", out_bytes));
  return absl::OkStatus();
}

}  // namespace hmoe
