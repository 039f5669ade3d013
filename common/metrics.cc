#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hmoe {

namespace metrics_internal {

// One child: exactly one of the members is set.
struct Child {
  std::unique_ptr<Counter> counter;
  std::unique_ptr<Gauge> gauge;
  std::unique_ptr<Histogram> histogram;
  std::function<double()> sample;
};

struct Family {
  std::mutex* mu = nullptr;  // the registry's
  Type type = Type::kCounter;
  std::string name, help;
  std::vector<std::string> label_names;
  std::vector<double> bounds;                          // histograms
  std::map<std::vector<std::string>, Child> children;  // guarded by *mu
};

}  // namespace metrics_internal

using metrics_internal::Child;
using metrics_internal::Family;
using metrics_internal::Type;

struct MetricsRegistry::Families {
  std::map<std::string, std::unique_ptr<Family>, std::less<>> by_name;
};

namespace {

const char* TypeName(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "?";
}

bool ValidMetricName(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool ValidLabelName(std::string_view s) {
  if (s.empty() || s.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Go's strconv.FormatFloat(v, 'g', -1, 64) for what we print, except that
// integral values below 1e15 are written without an exponent.
void AppendValue(std::string* out, double v) {
  if (std::isnan(v)) {
    out->append("NaN");
  } else if (std::isinf(v)) {
    out->append(v > 0 ? "+Inf" : "-Inf");
  } else if (v == std::trunc(v) && std::fabs(v) < 1e15) {
    absl::StrAppend(out, static_cast<int64_t>(v));
  } else {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round trip
    out->append(buf, r.ptr);
  }
}

void AppendEscaped(std::string* out, std::string_view s, bool quote) {
  for (char c : s) {
    if (c == '\\')
      out->append("\\\\");
    else if (c == '\n')
      out->append("\\n");
    else if (c == '"' && quote)
      out->append("\\\"");
    else
      out->push_back(c);
  }
}

// `{a="x",b="y"` plus `extra` (an already formatted `le="..."`), then `}`;
// nothing when there are no labels at all.
void AppendLabels(std::string* out, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, std::string_view extra = {}) {
  if (names.empty() && extra.empty()) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    out->append(names[i]);
    out->append("=\"");
    AppendEscaped(out, values[i], /*quote=*/true);
    out->push_back('"');
  }
  if (!extra.empty()) {
    if (!names.empty()) out->push_back(',');
    out->append(extra);
  }
  out->push_back('}');
}

void AppendSample(std::string* out, std::string_view name, std::string_view suffix,
                  const std::vector<std::string>& names, const std::vector<std::string>& values,
                  double v, std::string_view extra = {}) {
  out->append(name);
  out->append(suffix);
  AppendLabels(out, names, values, extra);
  out->push_back(' ');
  AppendValue(out, v);
  out->push_back('\n');
}

absl::StatusOr<std::vector<std::string>> CheckValues(const Family& f,
                                                     absl::Span<const std::string_view> values) {
  if (values.size() != f.label_names.size())
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", f.name, ": ", values.size(), " label values for ",
                     f.label_names.size(), " labels (", absl::StrJoin(f.label_names, ","), ")"));
  return std::vector<std::string>(values.begin(), values.end());
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // NaN compares false with every bound: +Inf.
  const size_t i = std::isnan(v)
                       ? bounds_.size()
                       : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                             bounds_.begin());
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = total;
  }
  s.count = total;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  if (!(start > 0) || !(factor > 1) || count < 1) return b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

absl::StatusOr<Counter*> CounterFamily::WithLabels(
    absl::Span<const std::string_view> values) const {
  auto key = CheckValues(*f_, values);
  if (!key.ok()) return key.status();
  std::lock_guard<std::mutex> lock(*f_->mu);
  Child& c = f_->children[*std::move(key)];
  if (!c.counter) c.counter = std::make_unique<Counter>();
  return c.counter.get();
}

absl::StatusOr<Gauge*> GaugeFamily::WithLabels(absl::Span<const std::string_view> values) const {
  auto key = CheckValues(*f_, values);
  if (!key.ok()) return key.status();
  std::lock_guard<std::mutex> lock(*f_->mu);
  Child& c = f_->children[*std::move(key)];
  if (c.sample)
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", f_->name, ": these label values name a callback gauge"));
  if (!c.gauge) c.gauge = std::make_unique<Gauge>();
  return c.gauge.get();
}

absl::StatusOr<Histogram*> HistogramFamily::WithLabels(
    absl::Span<const std::string_view> values) const {
  auto key = CheckValues(*f_, values);
  if (!key.ok()) return key.status();
  std::lock_guard<std::mutex> lock(*f_->mu);
  Child& c = f_->children[*std::move(key)];
  if (!c.histogram) c.histogram = std::make_unique<Histogram>(f_->bounds);
  return c.histogram.get();
}

CallbackGauge::~CallbackGauge() { reg_->RemoveCallback(f_, values_); }

MetricsRegistry::MetricsRegistry() : families_(std::make_unique<Families>()) {}
MetricsRegistry::~MetricsRegistry() = default;

absl::StatusOr<Family*> MetricsRegistry::AddFamily(Type type, std::string_view name_view,
                                                   std::string_view help,
                                                   std::vector<std::string> label_names,
                                                   std::vector<double> bounds) {
  const std::string name(name_view);
  if (!ValidMetricName(name))
    return absl::InvalidArgumentError(absl::StrCat("metric name \"", name, "\" is not valid"));
  if ((type == Type::kCounter) != EndsWith(name, "_total"))
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, ": a counter's name ends in _total, no other's does"));
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& l = label_names[i];
    if (!ValidLabelName(l) || (type == Type::kHistogram && l == "le"))
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": label name \"", l, "\" is not valid"));
    for (size_t j = 0; j < i; ++j)
      if (label_names[j] == l)
        return absl::InvalidArgumentError(
            absl::StrCat("metric ", name, ": label name \"", l, "\" repeats"));
  }
  if (type == Type::kHistogram) {
    if (!bounds.empty() && bounds.back() == INFINITY) bounds.pop_back();
    for (size_t i = 0; i < bounds.size(); ++i)
      if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
        return absl::InvalidArgumentError(absl::StrCat(
            "metric ", name, ": bucket bounds must be finite and strictly increasing"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_->by_name.find(name);
  if (it != families_->by_name.end()) {
    Family& f = *it->second;
    if (f.type != type || f.help != help || f.label_names != label_names || f.bounds != bounds)
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, " is already registered as another ", TypeName(f.type),
                       " (help, labels or buckets differ)"));
    return &f;
  }
  auto f = std::make_unique<Family>();
  f->mu = &mu_;
  f->type = type;
  f->name = name;
  f->help = std::string(help);
  f->label_names = std::move(label_names);
  f->bounds = std::move(bounds);
  Family* p = f.get();
  families_->by_name.emplace(p->name, std::move(f));
  return p;
}

absl::StatusOr<CounterFamily> MetricsRegistry::AddCounterFamily(
    std::string_view name, std::string_view help, std::vector<std::string> label_names) {
  auto f = AddFamily(Type::kCounter, name, help, std::move(label_names), {});
  if (!f.ok()) return f.status();
  return CounterFamily(*f);
}

absl::StatusOr<GaugeFamily> MetricsRegistry::AddGaugeFamily(std::string_view name,
                                                            std::string_view help,
                                                            std::vector<std::string> label_names) {
  auto f = AddFamily(Type::kGauge, name, help, std::move(label_names), {});
  if (!f.ok()) return f.status();
  return GaugeFamily(*f);
}

absl::StatusOr<HistogramFamily> MetricsRegistry::AddHistogramFamily(
    std::string_view name, std::string_view help, std::vector<double> bounds,
    std::vector<std::string> label_names) {
  auto f = AddFamily(Type::kHistogram, name, help, std::move(label_names), std::move(bounds));
  if (!f.ok()) return f.status();
  return HistogramFamily(*f);
}

absl::StatusOr<Counter*> MetricsRegistry::AddCounter(std::string_view name, std::string_view help) {
  auto f = AddCounterFamily(name, help, {});
  if (!f.ok()) return f.status();
  return f->WithLabels({});
}

absl::StatusOr<Gauge*> MetricsRegistry::AddGauge(std::string_view name, std::string_view help) {
  auto f = AddGaugeFamily(name, help, {});
  if (!f.ok()) return f.status();
  return f->WithLabels({});
}

absl::StatusOr<Histogram*> MetricsRegistry::AddHistogram(std::string_view name,
                                                         std::string_view help,
                                                         std::vector<double> bounds) {
  auto f = AddHistogramFamily(name, help, std::move(bounds), {});
  if (!f.ok()) return f.status();
  return f->WithLabels({});
}

absl::StatusOr<std::unique_ptr<CallbackGauge>> MetricsRegistry::AddCallbackGauge(
    std::string_view name, std::string_view help, std::vector<std::string> label_names,
    std::vector<std::string> label_values, std::function<double()> sample) {
  const std::string n(name);
  if (!sample) return absl::InvalidArgumentError(absl::StrCat("metric ", n, ": no callback"));
  if (label_values.size() != label_names.size())
    return absl::InvalidArgumentError(absl::StrCat("metric ", n, ": ", label_values.size(),
                                                   " label values for ", label_names.size(),
                                                   " labels"));
  auto f = AddFamily(Type::kGauge, name, help, std::move(label_names), {});
  if (!f.ok()) return f.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = (*f)->children.try_emplace(label_values);
  if (!inserted)
    return absl::AlreadyExistsError(absl::StrCat("metric ", n, ": a child with label values {",
                                                 absl::StrJoin(label_values, ","),
                                                 "} already exists"));
  it->second.sample = std::move(sample);
  return std::unique_ptr<CallbackGauge>(new CallbackGauge(this, *f, std::move(label_values)));
}

void MetricsRegistry::RemoveCallback(Family* f, const std::vector<std::string>& values) {
  std::lock_guard<std::mutex> lock(mu_);
  f->children.erase(values);
}

std::string MetricsRegistry::RenderPrometheus() const {
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, fp] : families_->by_name) {
    const Family& f = *fp;
    out.append("# HELP ");
    out.append(name);
    out.push_back(' ');
    AppendEscaped(&out, f.help, /*quote=*/false);
    out.append("\n# TYPE ");
    out.append(name);
    out.push_back(' ');
    out.append(TypeName(f.type));
    out.push_back('\n');
    for (const auto& [values, c] : f.children) {
      if (c.counter) {
        AppendSample(&out, name, "", f.label_names, values, c.counter->value());
      } else if (c.gauge) {
        AppendSample(&out, name, "", f.label_names, values, c.gauge->value());
      } else if (c.sample) {
        AppendSample(&out, name, "", f.label_names, values, c.sample());
      } else if (c.histogram) {
        const Histogram::Snapshot s = c.histogram->snapshot();
        std::string le;
        for (size_t i = 0; i <= f.bounds.size(); ++i) {
          le.assign("le=\"");
          AppendValue(&le, i < f.bounds.size() ? f.bounds[i] : INFINITY);
          le.push_back('"');
          AppendSample(&out, name, "_bucket", f.label_names, values,
                       static_cast<double>(s.cumulative[i]), le);
        }
        AppendSample(&out, name, "_sum", f.label_names, values, s.sum);
        AppendSample(&out, name, "_count", f.label_names, values, static_cast<double>(s.count));
      }
    }
  }
  return out;
}

}  // namespace hmoe
