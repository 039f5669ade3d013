// MetricsRegistry: a small thread-safe registry of counters, gauges and
// histograms, each a family with optional label names and one child per
// tuple of label values, plus gauges sampled from a callback at scrape time.
// RenderPrometheus writes the Prometheus text exposition format 0.0.4.
//
// Cost: a child's Increment / Set / Add / Observe is lock-free (relaxed
// atomics). Finding a child (WithLabels, the Add* calls) takes the
// registry's lock: look children up once, keep the pointer, and use it on
// the hot path. Families and their children live as long as the registry
// (a callback gauge until its handle is destroyed); they are never removed.
//
// Registering a family again with the same type, help, label names (and
// buckets) returns the existing one, so several owners (or one re-created
// owner) may share a registry; any difference is ALREADY_EXISTS.
//
// Usage:
//   MetricsRegistry reg;
//   ASSIGN_OR_RETURN(CounterFamily fam,
//                    reg.AddCounterFamily("hmoe_requests_finished_total", "...", {"outcome"}));
//   ASSIGN_OR_RETURN(Counter* stop, fam.WithLabels({"stop"}));
//   stop->Increment();
//   std::string body = reg.RenderPrometheus();  // serve with kPrometheusContentType
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hmoe {

// The Content-Type of RenderPrometheus's text.
inline constexpr std::string_view kPrometheusContentType =
    "text/plain; version=0.0.4; charset=utf-8";

// Only goes up. Increment by v >= 0; a negative or NaN v is ignored.
class Counter {
 public:
  void Increment(double v = 1.0) {
    if (v >= 0) value_.fetch_add(v, std::memory_order_relaxed);
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Fixed buckets: an observation v counts in the first bucket whose upper
// bound is >= v (Prometheus' `le`), else (and for NaN) in +Inf.
class Histogram {
 public:
  // `bounds`: strictly increasing, finite (checked by the registry).
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  // Concurrent observations may be partly seen; count always equals the
  // +Inf bucket.
  Snapshot snapshot() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

namespace metrics_internal {
struct Family;
enum class Type { kCounter, kGauge, kHistogram };
}  // namespace metrics_internal

// Handles to a family: cheap to copy, valid while the registry lives.
// WithLabels returns the child for `values` (one per label name, in order;
// else INVALID_ARGUMENT), creating it at 0 the first time; the pointer stays
// valid while the registry lives. Takes the registry's lock.
class CounterFamily {
 public:
  absl::StatusOr<Counter*> WithLabels(absl::Span<const std::string_view> values) const;

 private:
  friend class MetricsRegistry;
  explicit CounterFamily(metrics_internal::Family* f) : f_(f) {}
  metrics_internal::Family* f_;
};

class GaugeFamily {
 public:
  // INVALID_ARGUMENT also when `values` name a callback gauge.
  absl::StatusOr<Gauge*> WithLabels(absl::Span<const std::string_view> values) const;

 private:
  friend class MetricsRegistry;
  explicit GaugeFamily(metrics_internal::Family* f) : f_(f) {}
  metrics_internal::Family* f_;
};

class HistogramFamily {
 public:
  absl::StatusOr<Histogram*> WithLabels(absl::Span<const std::string_view> values) const;

 private:
  friend class MetricsRegistry;
  explicit HistogramFamily(metrics_internal::Family* f) : f_(f) {}
  metrics_internal::Family* f_;
};

class MetricsRegistry;

// A registered callback gauge; destroying it unregisters the callback
// (waiting for a scrape that is calling it). Must not outlive its registry.
class CallbackGauge {
 public:
  ~CallbackGauge();
  CallbackGauge(const CallbackGauge&) = delete;
  CallbackGauge& operator=(const CallbackGauge&) = delete;

 private:
  friend class MetricsRegistry;
  CallbackGauge(MetricsRegistry* reg, metrics_internal::Family* f, std::vector<std::string> values)
      : reg_(reg), f_(f), values_(std::move(values)) {}
  MetricsRegistry* reg_;
  metrics_internal::Family* f_;
  std::vector<std::string> values_;
};

// Buckets for latencies: `count` bounds start, start*factor, ... (start > 0,
// factor > 1, count >= 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Names match [a-zA-Z_:][a-zA-Z0-9_:]*; a counter's ends in "_total",
  // no other's does. Label names match [a-zA-Z_][a-zA-Z0-9_]*, do not start
  // with "__", are distinct, and a histogram's are not "le". INVALID_ARGUMENT
  // otherwise; ALREADY_EXISTS for a name registered differently.
  absl::StatusOr<CounterFamily> AddCounterFamily(std::string_view name, std::string_view help,
                                                 std::vector<std::string> label_names);
  absl::StatusOr<GaugeFamily> AddGaugeFamily(std::string_view name, std::string_view help,
                                             std::vector<std::string> label_names);
  // `bounds`: the buckets' upper bounds, strictly increasing and finite
  // (+Inf is always added; a trailing +Inf given here is dropped).
  absl::StatusOr<HistogramFamily> AddHistogramFamily(std::string_view name, std::string_view help,
                                                     std::vector<double> bounds,
                                                     std::vector<std::string> label_names);

  // Families without labels: their one child.
  absl::StatusOr<Counter*> AddCounter(std::string_view name, std::string_view help);
  absl::StatusOr<Gauge*> AddGauge(std::string_view name, std::string_view help);
  absl::StatusOr<Histogram*> AddHistogram(std::string_view name, std::string_view help,
                                          std::vector<double> bounds);

  // A gauge child whose value is `sample()`, called on every
  // RenderPrometheus under the registry's lock (so it must be quick, must
  // not block on anything that waits for the registry, and must not call
  // into it) until the returned handle is destroyed. The family is a gauge
  // family as AddGaugeFamily registers (and may hold plain gauges too);
  // ALREADY_EXISTS when `label_values` already name a child.
  absl::StatusOr<std::unique_ptr<CallbackGauge>> AddCallbackGauge(
      std::string_view name, std::string_view help, std::vector<std::string> label_names,
      std::vector<std::string> label_values, std::function<double()> sample);

  // Every family in name order, each child in label-value order: `# HELP`,
  // `# TYPE`, then the samples (histograms: cumulative `_bucket{le=...}`
  // with +Inf, `_sum`, `_count`). Label values escape `\`, `"` and newline;
  // help text `\` and newline.
  std::string RenderPrometheus() const;

 private:
  friend class CallbackGauge;
  absl::StatusOr<metrics_internal::Family*> AddFamily(metrics_internal::Type type,
                                                      std::string_view name, std::string_view help,
                                                      std::vector<std::string> label_names,
                                                      std::vector<double> bounds);
  void RemoveCallback(metrics_internal::Family* f, const std::vector<std::string>& values);

  mutable std::mutex mu_;
  struct Families;
  std::unique_ptr<Families> families_;  // guarded by mu_
};

}  // namespace hmoe
