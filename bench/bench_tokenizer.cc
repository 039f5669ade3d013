// hmoe-bench-tokenizer: encoding speed of a model directory's tokenizer
// (Tokenizer::FromModelDir: tokenizer.json, or the tiktoken format) against
// the Python package that defines it, on the same corpus in the same run.
// For a tiktoken.model directory the Python side is bench/tiktoken_bench.py
// (the `tiktoken` package as tokenization_kimi.py drives it); both sides
// encode each document of the corpus on its own ("docs", request-sized
// texts) and the whole file as one text ("whole"), one thread, passes
// repeated for --seconds, and both hash their ids: the table says whether
// they are equal. Needs a Python with the packages of
// tests/fixtures/make_tiktoken_fixture_requirements.txt (--python), unless
// --no-reference.
//
// Flags: AddFlags below (--help; docs/FLAGS.md). Exit 0 on success, 2 on a
// bad flag, 1 on any other failure (the Python side's included).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "common/small_file.h"
#include "common/status.h"
#include "common/text/tokenizer.h"

namespace hmoe {
namespace {

struct Args {
  std::string model_dir, corpus, python = "python3", script;
  double seconds = 2;
  bool run_python = true;
};

std::string SourceDir() {
  const char* env = std::getenv("HMOE_SOURCE_DIR");
  return env && *env ? env : HMOE_SOURCE_DIR;
}

void AddFlags(FlagSet& fs, Args* a) {
  fs.String("model-dir", &a->model_dir, "DIR",
            "model directory with tiktoken.model + tokenizer_config.json (default: the "
            "fixture, $HMOE_SOURCE_DIR/tests/fixtures/tiktoken)");
  fs.String("corpus", &a->corpus, "FILE",
            "docs separated by \"\\n%\\n\" (default: tests/fixtures/corpus_heldout.txt)");
  fs.Double(
      "seconds", &a->seconds, "repeat each measurement for at least this long",
      [](double s) { return s > 0 && s <= 600; }, "a number of seconds in (0, 600]");
  fs.String("python", &a->python, "PATH", "the Python that runs the reference side");
  fs.String("script", &a->script, "FILE",
            "the reference side (default: $HMOE_SOURCE_DIR/bench/tiktoken_bench.py)");
  fs.Bool("reference", &a->run_python, "run the Python side (--no-reference: ours only)");
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) h = (h ^ ((u >> (8 * k)) & 0xff)) * 0x100000001b3ull;
  }
  return absl::StrFormat("%016x", h);
}

struct Measure {
  int64_t tokens = 0;  // one pass
  double seconds = 0;
  int passes = 0;
  std::string fnv;
};

absl::StatusOr<Measure> MeasureOurs(const Tokenizer& tok, const std::vector<std::string>& texts,
                                    double seconds) {
  Measure m;
  std::vector<int32_t> all;
  for (const std::string& t : texts) {
    ASSIGN_OR_RETURN(auto ids, tok.Encode(t));
    all.insert(all.end(), ids.begin(), ids.end());
  }
  m.tokens = static_cast<int64_t>(all.size());
  m.fnv = Fnv1a64(all);
  const double start = Now();
  do {
    for (const std::string& t : texts) {
      ASSIGN_OR_RETURN(auto ids, tok.Encode(t));
      if (ids.empty() && !t.empty()) return absl::InternalError("no ids");
    }
    ++m.passes;
    m.seconds = Now() - start;
  } while (m.seconds < seconds);
  return m;
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

absl::StatusOr<nlohmann::json> RunPython(const Args& a) {
  const std::string cmd = absl::StrCat(ShellQuote(a.python), " ", ShellQuote(a.script),
                                       " --model-dir ", ShellQuote(a.model_dir), " --corpus ",
                                       ShellQuote(a.corpus), " --seconds ", a.seconds);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return absl::InternalError(absl::StrCat("cannot run ", cmd));
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0)
    return absl::FailedPreconditionError(
        absl::StrCat(cmd, " failed (status ", rc,
                     "); it needs tests/fixtures/make_tiktoken_fixture_requirements.txt installed "
                     "(--python), or run with --no-reference"));
  try {
    return nlohmann::json::parse(out);
  } catch (const nlohmann::json::exception& e) {
    return absl::InternalError(absl::StrCat(cmd, " printed no JSON: ", e.what()));
  }
}

absl::Status Run(const Args& a) {
  ASSIGN_OR_RETURN(auto tok, Tokenizer::FromModelDir(a.model_dir));
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(a.corpus, kMaxTokenizerJsonBytes));
  const std::vector<std::string> docs = absl::StrSplit(text, "\n%\n");
  std::printf("hmoe-bench-tokenizer: %s (%d ids), corpus %s (%zu bytes, %zu docs), one thread\n",
              a.model_dir.c_str(), tok->vocab_size(), a.corpus.c_str(), text.size(), docs.size());
  ASSIGN_OR_RETURN(const Measure ours_docs, MeasureOurs(*tok, docs, a.seconds));
  ASSIGN_OR_RETURN(const Measure ours_whole, MeasureOurs(*tok, {text}, a.seconds));
  nlohmann::json py;
  if (a.run_python) {
    ASSIGN_OR_RETURN(py, RunPython(a));
    std::printf("reference: tiktoken %s (%s %s)\n", py.value("tiktoken", "?").c_str(),
                a.python.c_str(), a.script.c_str());
  }
  // "tiktoken": as tokenization_kimi.py drives it (its cuts in Python);
  // "raw": Encoding.encode alone.
  std::printf("%-6s %12s %10s %14s %7s %14s %7s %10s\n", "mode", "ours tok/s", "ours MB/s",
              "tiktoken tok/s", "ratio", "raw tok/s", "ratio", "ids equal");
  bool all_equal = true;
  for (const auto& [name, m] : {std::pair<const char*, const Measure&>{"docs", ours_docs},
                                std::pair<const char*, const Measure&>{"whole", ours_whole}}) {
    const double tps = static_cast<double>(m.tokens) * m.passes / m.seconds;
    const double mbps = static_cast<double>(text.size()) * m.passes / m.seconds / 1e6;
    if (!a.run_python) {
      std::printf("%-6s %12.0f %10.2f %14s %7s %14s %7s %10s\n", name, tps, mbps, "-", "-", "-",
                  "-", "-");
      continue;
    }
    const auto rate = [](const nlohmann::json& r) {
      return r.at("tokens").get<double>() * r.at("passes").get<double>() /
             r.at("seconds").get<double>();
    };
    const nlohmann::json& r = py.at(name);
    const double py_tps = rate(r), raw_tps = rate(py.at(absl::StrCat(name, "_raw")));
    const bool equal =
        r.at("fnv1a64").get<std::string>() == m.fnv && r.at("tokens").get<int64_t>() == m.tokens;
    all_equal = all_equal && equal;
    std::printf("%-6s %12.0f %10.2f %14.0f %6.2fx %14.0f %6.2fx %10s\n", name, tps, mbps, py_tps,
                tps / py_tps, raw_tps, tps / raw_tps, equal ? "yes" : "NO");
  }
  if (!all_equal)
    return absl::InternalError(
        "the ids differ from the reference's (see tests/common/tiktoken_test)");
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Args args;
  FlagSet fs("hmoe-bench-tokenizer", "[flags]",
             "Encoding speed of a model directory's tokenizer against the Python package\n"
             "(tiktoken for tiktoken.model), same corpus, same run, one thread.\n"
             "Exit 0 on success, 2 on a bad flag, 1 on any other failure.");
  AddFlags(fs, &args);
  if (std::optional<int> exit = fs.ParseOrExit(argc, argv)) return *exit;
  if (args.model_dir.empty()) args.model_dir = SourceDir() + "/tests/fixtures/tiktoken";
  if (args.corpus.empty()) args.corpus = SourceDir() + "/tests/fixtures/corpus_heldout.txt";
  if (args.script.empty()) args.script = SourceDir() + "/bench/tiktoken_bench.py";
  const absl::Status st = Run(args);
  if (!st.ok()) {
    std::fprintf(stderr, "hmoe-bench-tokenizer: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
