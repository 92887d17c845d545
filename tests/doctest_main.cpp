// doctest's main for every test binary, with Bazel's test sharding: under `shard_count = N`, Bazel
// runs the binary N times with TEST_TOTAL_SHARDS=N and TEST_SHARD_INDEX=i, and shard i runs every
// N-th test case from the i-th (in doctest's order, by file and line), so the slow cases of one
// file spread over the shards. Without those variables it is doctest's own main.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

// Collects the names of the test cases a listing run (--list-test-cases) selects, in order.
struct NameCollector : doctest::IReporter {
  static inline std::vector<std::string> names;

  explicit NameCollector(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData& query) override {
    for (unsigned i = 0; i < query.num_data; ++i) names.emplace_back(query.data[i]->m_name);
  }
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

REGISTER_REPORTER("stagewise_names", 0, NameCollector);

// A test case name as one item of doctest's comma-separated filter: commas and backslashes escaped.
std::string filter_item(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (c == ',' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

int parse_count(const char* text, const char* variable) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < 0 || value > 100000) {
    std::cerr << "doctest_main: " << variable << "='" << text << "' is not a shard number\n";
    std::exit(2);
  }
  return static_cast<int>(value);
}

}  // namespace

int main(int argc, char** argv) {
  const char* total_text = std::getenv("TEST_TOTAL_SHARDS");
  const char* index_text = std::getenv("TEST_SHARD_INDEX");
  if (total_text == nullptr || index_text == nullptr) {
    doctest::Context context(argc, argv);
    return context.run();
  }
  const int total = parse_count(total_text, "TEST_TOTAL_SHARDS");
  const int index = parse_count(index_text, "TEST_SHARD_INDEX");
  if (total < 1 || index >= total) {
    std::cerr << "doctest_main: shard " << index << " of " << total << " does not exist\n";
    return 2;
  }
  // Tells Bazel that this binary shards (it fails a sharded test whose binary does not).
  if (const char* status = std::getenv("TEST_SHARD_STATUS_FILE")) std::ofstream{status};

  // The user's arguments (filters included) and ours, parsed as doctest parses a command line.
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args(argv, argv + argc);
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto run = [](const std::vector<std::string>& args) {
    std::vector<const char*> pointers;
    for (const auto& a : args) pointers.push_back(a.c_str());
    doctest::Context context(static_cast<int>(pointers.size()), pointers.data());
    return context.run();
  };
  run(with({"--list-test-cases", "--reporters=stagewise_names"}));
  std::string filter;
  int mine = 0;
  for (std::size_t i = index; i < NameCollector::names.size(); i += total) {
    if (!filter.empty()) filter += ',';
    filter += filter_item(NameCollector::names[i]);
    ++mine;
  }
  std::cout << "doctest_main: shard " << index << " of " << total << ": " << mine << " of "
            << NameCollector::names.size() << " test cases\n";
  if (mine == 0) return 0;
  return run(with({"--test-case=" + filter}));
}
