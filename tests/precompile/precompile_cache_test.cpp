// moejit-precompile against the real on-disk cache: warming, second runs, the runtime's
// no-compile lookups, concurrent runs, --verify/--repair, and that failures leave the cache valid.
// Host only (targets sm_90 without a GPU). Keeps compiles few: NVRTC takes ~0.1-0.2 s each.
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "cache_entry.h"
#include "gtest/gtest.h"
#include "moejit_internal.h"
#include "precompile_inputs.h"
#include "tool_runner.h"

namespace moejit {
namespace precompile {
namespace {

using nlohmann::json;
using test::configs;

const Target kSm90{90, false};
const char* kExamples[] = {"deepseek-v3.json", "mixtral-8x7b.json", "qwen3-30b-a3b.json",
                           "gpt-oss-120b.json"};
// One layout and index type per example keeps the suite fast; Mixtral also gets the full default
// expansion (every layout, both index types) once. The plain combine only: the examples' configs
// would add their epilogues (tests/precompile/precompile_inputs_test.cpp expands those).
const char* kNarrow = " --layout gather_map --index-type int32";
const char* kPlain = " --epilogue none";

// gather_map/int32 modules per example: the prefill module, the decode one where it differs (K = 2:
// one slot per thread, not four) or the mid-size one (K = 8: 16-slot groups, eight per block), and
// the one-token module; at K = 4 (gpt-oss-120b) decode and mid-size calls take the prefill module.
size_t narrow_modules(const std::string& file) {
  return file == "gpt-oss-120b.json" ? 2 : 3;
}

// What the tool should have warmed, expanded with the same library functions.
std::vector<KernelSpec> expected_specs(const std::string& file, bool full) {
  const ModelConfig c = read_model_config(configs(file));
  Shape s;
  s.hidden = c.hidden;
  s.top_k = c.top_k;
  s.dtype = s.out_dtype = parse_dtype(*c.dtype, file);
  std::vector<KernelSpec> specs;
  if (full)
    expand_shape(s, all_layouts(), all_index_types(), &specs);
  else
    expand_shape(s, {MOEJIT_LAYOUT_GATHER_MAP}, {MOEJIT_INDEX_INT32}, &specs);
  return specs;
}

json parse_json(const test::ToolRun& r) {
  try {
    return json::parse(r.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "stdout is not JSON: " << e.what() << "\n" << r.out << "\n" << r.err;
    return json::object();
  }
}

class WarmedCache : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    unsetenv("MOEJIT_TEMPLATE_DIR");
    unsetenv("MOEJIT_CACHE_MODE");
    scratch_ = test::make_temp_dir("pc-cache");
    cache_ = scratch_ + "/cache";
    first_seconds_ = 0;
    expected_entries_ = 0;
    for (const char* file : kExamples) {
      const test::ToolRun r = warm(file, false);
      first_seconds_ += r.seconds;
      ASSERT_EQ(r.rc, 0) << file << "\n" << r.err;
      const json j = parse_json(r);
      const size_t modules = narrow_modules(file);
      EXPECT_EQ(j["compiled"], modules) << file;
      EXPECT_EQ(j["compiled"], expected_specs(file, false).size()) << file;
      EXPECT_EQ(j["failed"], 0) << file;
      EXPECT_GT(j["bytes_written"].get<uint64_t>(), 0u) << file;
      expected_entries_ += modules;
    }
    const test::ToolRun full = warm("mixtral-8x7b.json", true);
    first_seconds_ += full.seconds;
    ASSERT_EQ(full.rc, 0) << full.err;
    const json j = parse_json(full);
    // 21 in all (token_major: one geometry at K=2, decode or not; gather_map: two geometries and
    // the one-token module per index type; token_index: the list path's modules for prefill and
    // mid-size calls (decode calls never take it at this shape), the single-launch modules and the
    // decode and mid-size ones' small-call forms (T = 65 with 66-128 rows), the one-token module
    // and the list helpers per index type); gather_map/int32 is already there.
    EXPECT_EQ(j["compiled"], 18);
    EXPECT_EQ(j["cached"], 3);
    expected_entries_ += 18;
  }
  static void TearDownTestSuite() { test::remove_tree(scratch_); }

  static test::ToolRun warm(const std::string& file, bool full, const std::string& extra = "",
                            const std::string& env = "") {
    return test::run_tool("--json -j 2 --arch sm_90 --model-config '" + configs(file) +
                              "' --cache-dir '" + cache_ + "'" + (full ? "" : kNarrow) + kPlain +
                              extra,
                          scratch_, env);
  }

  static void expect_cache_valid(size_t entries) {
    const CacheVerifyReport r = verify_cache_dir(cache_, false);
    EXPECT_EQ(r.entries, entries);
    EXPECT_EQ(r.valid, entries);
    EXPECT_TRUE(r.invalid.empty()) << r.invalid.front().path << ": " << r.invalid.front().why;
  }

  static std::string scratch_, cache_;
  static double first_seconds_;
  static size_t expected_entries_;
};

std::string WarmedCache::scratch_, WarmedCache::cache_;
double WarmedCache::first_seconds_;
size_t WarmedCache::expected_entries_;

TEST_F(WarmedCache, CreatesTheExpectedEntries) {
  expect_cache_valid(expected_entries_);
}

TEST_F(WarmedCache, SecondRunCompilesNothingAndIsFast) {
  double second_seconds = 0;
  for (const char* file : kExamples) {
    const test::ToolRun r = warm(file, false);
    second_seconds += r.seconds;
    ASSERT_EQ(r.rc, 0) << r.err;
    const json j = parse_json(r);
    EXPECT_EQ(j["compiled"], 0) << file;
    EXPECT_EQ(j["cached"], narrow_modules(file)) << file;
    EXPECT_EQ(j["bytes_written"], 0) << file;
  }
  const test::ToolRun full = warm("mixtral-8x7b.json", true);
  second_seconds += full.seconds;
  EXPECT_EQ(parse_json(full)["compiled"], 0);
  EXPECT_EQ(parse_json(full)["cached"], 21);
  // The first pass paid NVRTC's start and every compile; the second only reads and validates files.
  EXPECT_LT(second_seconds, 0.5 * first_seconds_)
      << "first " << first_seconds_ << " s, second " << second_seconds << " s";
  expect_cache_valid(expected_entries_);
}

// A second run over a warm cache prints its one-line summary and nothing else: no progress line
// per kernel found in the cache (stderr is not a terminal here, as in CI logs).
TEST_F(WarmedCache, SecondRunPrintsOneLine) {
  const test::ToolRun r =
      test::run_tool("-j 2 --arch sm_90 --model-config '" + configs("qwen3-30b-a3b.json") +
                         "' --cache-dir '" + cache_ + "'" + kNarrow + kPlain,
                     scratch_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_NE(r.out.find("0 compiled, 3 already cached, 0 failed"), std::string::npos) << r.out;
}

TEST_F(WarmedCache, DryRunReportsEverythingCached) {
  const test::ToolRun r = warm("mixtral-8x7b.json", true, " --dry-run");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = parse_json(r);
  EXPECT_EQ(j["cached"], 21);
  EXPECT_EQ(j["missing"], 0);
}

TEST_F(WarmedCache, NoCompileRuntimeFindsEverySpecialization) {
  Settings settings;
  settings.cache_dir = cache_;
  settings.cache_mode = MOEJIT_CACHE_MODE_NO_COMPILE;
  Stats stats;
  KernelStore store(settings, stats);
  ASSERT_TRUE(store.has_disk_cache());
  size_t looked_up = 0;
  for (const char* file : kExamples)
    for (const KernelSpec& spec : expected_specs(file, std::string(file) == "mixtral-8x7b.json")) {
      // Exactly what moe_combine() plans for 256-byte-aligned, unpadded buffers.
      KernelStore::Source source;
      EXPECT_NO_THROW(store.obtain(spec, kSm90, &source)) << file << " " << spec.describe();
      EXPECT_EQ(source, KernelStore::Source::kDisk);
      ++looked_up;
    }
  EXPECT_EQ(looked_up, expected_entries_);
  EXPECT_EQ(stats.compiles.load(), 0u);
  EXPECT_EQ(stats.disk_hits.load(), looked_up);
}

TEST_F(WarmedCache, BadInputsAndFailedCompilesLeaveTheCacheValid) {
  const std::string dir = " --cache-dir '" + cache_ + "' --arch sm_90";
  test::write_file(scratch_ + "/broken.json", "{\"hidden_size\": ");
  test::write_file(scratch_ + "/fp8.json",
                   R"({"hidden_size": 64, "num_experts_per_tok": 2, "torch_dtype": "float8"})");
  for (const std::string& args :
       {"--model-config '" + scratch_ + "/missing.json'" + dir,
        "--model-config '" + scratch_ + "/broken.json'" + dir,
        "--model-config '" + scratch_ + "/fp8.json'" + dir, "--hidden 64 --topk 2" + dir,
        "--hidden 64 --topk 2 --dtype bf16 --arch sm_1" + dir}) {
    const test::ToolRun r = test::run_tool(args, scratch_);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.err;
  }

  // A compile failure: templates that do not compile (development override directory).
  const std::string broken = scratch_ + "/templates";
  ASSERT_EQ(mkdir(broken.c_str(), 0700), 0);
  // Every template, the one every kernel family includes broken.
  for (const auto& [name, bytes] : load_templates("", "template_dir"))
    test::write_file(broken + "/" + name, name == "combine_common.cuh"
                                              ? bytes + "\n#error deliberately broken template\n"
                                              : bytes);
  const test::ToolRun r =
      warm("qwen3-30b-a3b.json", false, "", "MOEJIT_TEMPLATE_DIR='" + broken + "' ");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("deliberately broken template"), std::string::npos) << r.err;
  EXPECT_EQ(parse_json(r)["failed"], 3);  // each gather_map/int32 module
  expect_cache_valid(expected_entries_);
}

TEST_F(WarmedCache, VerifyReportsAndRepairsInvalidEntries) {
  // Truncate one entry the tool wrote, as a crash of a non-atomic writer would.
  Settings settings;
  settings.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  Stats stats;
  KernelStore keys(settings, stats);
  const KernelSpec spec = expected_specs("gpt-oss-120b.json", false).at(0);
  const std::string path = cache_entry_path(cache_, cache_key(keys.request_for(spec, kSm90)));
  const std::string bytes = test::slurp(path);
  ASSERT_GT(bytes.size(), 64u) << path;
  const std::string dir = " --cache-dir '" + cache_ + "'";
  test::ToolRun r = test::run_tool("--verify --json" + dir, scratch_);
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  const uint64_t all_bytes = parse_json(r)["bytes"];
  test::write_file(path, bytes.substr(0, bytes.size() / 2));

  r = test::run_tool("--verify --json" + dir, scratch_);
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_EQ(parse_json(r)["bytes"], all_bytes - bytes.size()) << "bytes count valid entries only";
  r = test::run_tool("--verify" + dir, scratch_);
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_NE(r.out.find(path), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::to_string(all_bytes - bytes.size()) + " bytes valid"),
            std::string::npos)
      << r.out;

  r = test::run_tool("--verify --repair --json" + dir, scratch_);
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  const json j = parse_json(r);
  EXPECT_EQ(j["removed"], 1);
  EXPECT_EQ(j["valid"], expected_entries_ - 1);

  r = test::run_tool("--verify" + dir, scratch_);
  EXPECT_EQ(r.rc, 0) << r.out << r.err;

  // Warming again restores exactly the removed entry.
  r = warm("gpt-oss-120b.json", false);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(parse_json(r)["compiled"], 1);
  expect_cache_valid(expected_entries_);
}

// ---- exit 0 means "servable by the runtime from this cache, as this user" -----------------------

const char* kOneModule = "--arch sm_90 --hidden 64 --topk 2 --dtype bf16 --layout token_major";

std::string only_key(const test::ToolRun& r) {
  const json j = parse_json(r);
  return j.contains("jobs") && j["jobs"].size() == 1 ? j["jobs"][0]["key"].get<std::string>() : "";
}

// A shard directory others can write: the runtime loads nothing from it (and cannot replace what
// is there), so a run that leaves an entry there must not exit 0, whatever file exists.
TEST(Servable, AnEntryInAShardOthersCanWriteFailsTheRun) {
  const std::string scratch = test::make_temp_dir("pc-servable-shard");
  const std::string cache = scratch + "/cache";
  const std::string args = std::string(kOneModule) + " --cache-dir '" + cache + "'";
  test::ToolRun r = test::run_tool(args + " --json", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string key = only_key(r);
  const std::string entry = cache_entry_path(cache, key);
  const std::string shard = std::filesystem::path(entry).parent_path().string();
  ASSERT_EQ(chmod(shard.c_str(), 0777), 0);
  r = test::run_tool(args, scratch);
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("the runtime would not serve " + entry), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("writable by group or others (mode 0777)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("1 not servable by the runtime"), std::string::npos) << r.out;
  r = test::run_tool(args + " --json", scratch);
  EXPECT_EQ(r.rc, 3);
  EXPECT_EQ(parse_json(r)["jobs"][0]["status"], "unservable") << r.out;
  test::remove_tree(scratch);
}

// Runs the tool with dir mounted read-only (a mount namespace of its own): an entry there cannot
// be replaced, even by root. Empty when this machine does not let the test mount.
std::string read_only_mount_prefix(const std::string& dir) {
  if (std::system("unshare -m true >/dev/null 2>&1") != 0) return "";
  return "unshare -m sh -c 'mount --make-rprivate / && mount --bind \"" + dir + "\" \"" + dir +
         "\" && mount -o remount,bind,ro \"" + dir + "\" && exec \"$0\" \"$@\"' ";
}

// A damaged entry that the tool cannot replace (a read-only volume): the runtime would miss it,
// so the run fails and names it (it said "warm" before). --verify --repair cannot remove it either,
// and says so instead of "removed".
TEST(Servable, ADamagedEntryTheToolCannotReplaceFailsTheRun) {
  const std::string scratch = test::make_temp_dir("pc-servable-ro");
  const std::string cache = scratch + "/cache";
  const std::string prefix = read_only_mount_prefix(cache);
  if (prefix.empty()) {
    test::remove_tree(scratch);
    GTEST_SKIP() << "cannot mount the cache read-only here (unshare -m needs root or "
                    "CAP_SYS_ADMIN)";
  }
  const std::string args = std::string(kOneModule) + " --cache-dir '" + cache + "'";
  test::ToolRun r = test::run_tool(args + " --json", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string entry = cache_entry_path(cache, only_key(r));
  const std::string bytes = test::slurp(entry);
  test::write_file(entry, bytes.substr(0, bytes.size() - 1) + "!");
  r = test::run_tool(args, scratch, prefix);
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("the runtime would not serve " + entry + ": payload checksum mismatch"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("Read-only file system"), std::string::npos) << r.err;  // the warning

  r = test::run_tool("--verify --repair --cache-dir '" + cache + "'", scratch, prefix);
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_EQ(r.out.find("removed invalid entry"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("invalid entry " + entry +
                       ": payload checksum mismatch; not removed: Read-only file system"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.err.find("1 invalid entries could not be removed"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::exists(entry));
  test::remove_tree(scratch);
}

// --verify judges entries as the runtime running as this user would: one another user owns is
// refused by the runtime, so it is invalid (exit 4), not "valid".
TEST(Verify, AnotherUsersEntryIsInvalid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an entry to another uid";
  const std::string scratch = test::make_temp_dir("pc-verify-owner");
  const std::string cache = scratch + "/cache";
  test::ToolRun r =
      test::run_tool(std::string(kOneModule) + " --json --cache-dir '" + cache + "'", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string entry = cache_entry_path(cache, only_key(r));
  ASSERT_EQ(chown(entry.c_str(), 65534, 65534), 0);
  r = test::run_tool("--verify --cache-dir '" + cache + "'", scratch);
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_NE(r.out.find("invalid entry " + entry + ": is owned by uid 65534"), std::string::npos)
      << r.out;
  test::remove_tree(scratch);
}

// --verify on a path that is a file, not a directory, says so (it said "does not exist").
TEST(Verify, AFileIsNotACacheDirectory) {
  const std::string scratch = test::make_temp_dir("pc-verify-file");
  test::write_file(scratch + "/file", "not a cache");
  test::ToolRun r = test::run_tool("--verify --cache-dir '" + scratch + "/file'", scratch);
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("exists and is not a directory"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("does not exist"), std::string::npos) << r.err;
  r = test::run_tool("--verify --cache-dir '" + scratch + "/nothing'", scratch);
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  test::remove_tree(scratch);
}

// With a cache key the tool writes authenticated entries, which a runtime with that key serves;
// --verify with the key checks their MAC. A key file others may read is refused (exit 2).
TEST(CacheKey, EntriesAreWrittenAndVerifiedUnderTheKey) {
  const std::string scratch = test::make_temp_dir("pc-key");
  const std::string cache = scratch + "/cache";
  const std::string key_file = scratch + "/key", other_key = scratch + "/other";
  test::write_file(key_file, std::string(32, 'k'));
  test::write_file(other_key, std::string(32, 'o'));
  chmod(key_file.c_str(), 0600);
  chmod(other_key.c_str(), 0600);
  const std::string args = std::string(kOneModule) + " --cache-dir '" + cache + "'";
  test::ToolRun r = test::run_tool(args + " --json --cache-key-file '" + key_file + "'", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(parse_json(r)["authenticated"], true);
  const std::string key = only_key(r);

  // Authenticated under that key, and only that one.
  const auto mac_key = read_mac_key_file(key_file, "test");
  const auto wrong_key = read_mac_key_file(other_key, "test");
  std::string why;
  const std::string entry = test::slurp(cache_entry_path(cache, key));
  EXPECT_TRUE(parse_cache_entry(entry, key, nullptr, &why, mac_key.get())) << why;
  EXPECT_FALSE(parse_cache_entry(entry, key, nullptr, &why, wrong_key.get()));

  r = test::run_tool("--verify --cache-dir '" + cache + "' --cache-key-file '" + key_file + "'",
                     scratch);
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("1 valid (authenticated)"), std::string::npos) << r.out;
  r = test::run_tool("--verify --cache-dir '" + cache + "' --cache-key-file '" + other_key + "'",
                     scratch);
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_NE(r.out.find("its MAC does not match the cache key in " + other_key), std::string::npos)
      << r.out;
  r = test::run_tool("--verify --cache-dir '" + cache + "'", scratch);  // no key: not examined
  EXPECT_EQ(r.rc, 0) << r.out << r.err;

  // A run with another key: the entry is not servable under it, so it is rebuilt and replaced.
  r = test::run_tool(args + " --json", scratch, "MOEJIT_CACHE_KEY_FILE='" + other_key + "' ");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(parse_json(r)["compiled"], 1) << r.out;

  chmod(key_file.c_str(), 0644);
  r = test::run_tool(args + " --cache-key-file '" + key_file + "'", scratch);
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("is accessible to group or others (mode 0644)"), std::string::npos) << r.err;
  test::remove_tree(scratch);
}

// A symlinked version directory: the runtime refuses it, so --verify reports an unusable cache
// (exit 3) and --repair deletes nothing through it.
TEST(Verify, SymlinkedVersionDirectoryIsUnusableAndNeverRepaired) {
  const std::string scratch = test::make_temp_dir("pc-verify-link");
  const std::string cache = scratch + "/cache";
  const std::string junk = scratch + "/elsewhere/ab/ab" + std::string(30, '0') + ".moejit";
  std::filesystem::create_directories(scratch + "/elsewhere/ab");
  test::write_file(junk, "junk, not an entry");
  ASSERT_EQ(mkdir(cache.c_str(), 0700), 0);
  std::filesystem::create_directory_symlink(scratch + "/elsewhere",
                                            cache + "/" + version_dir_name());
  for (const char* args : {"--verify", "--verify --repair", "--verify --repair --json"}) {
    const test::ToolRun r =
        test::run_tool(std::string(args) + " --cache-dir '" + cache + "'", scratch);
    EXPECT_EQ(r.rc, 3) << args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("symbolic link"), std::string::npos) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(cache), std::string::npos) << args << "\n" << r.err;
    EXPECT_TRUE(std::filesystem::exists(junk)) << args;
  }
  test::remove_tree(scratch);
}

TEST(Concurrency, ParallelJobsAndTwoProcessesIntoOneDirectory) {
  unsetenv("MOEJIT_TEMPLATE_DIR");
  const std::string scratch = test::make_temp_dir("pc-conc");
  const std::string args = "--json -j 2 --arch sm_90 --model-config '" +
                           configs("qwen3-30b-a3b.json") + "' --cache-dir '" + scratch + "/cache'" +
                           kPlain;
  test::ToolRun a, b;
  std::thread other([&] { b = test::run_tool(args, scratch); });
  a = test::run_tool(args, scratch);
  other.join();
  const size_t expected = expected_specs("qwen3-30b-a3b.json", true).size();
  for (const test::ToolRun* r : {&a, &b}) {
    EXPECT_EQ(r->rc, 0) << r->err;
    const json j = parse_json(*r);
    EXPECT_EQ(j["total"], expected);
    EXPECT_EQ(j["failed"], 0);
    EXPECT_EQ(j["compiled"].get<size_t>() + j["cached"].get<size_t>(), expected);
  }
  const CacheVerifyReport v = verify_cache_dir(scratch + "/cache", false);
  EXPECT_EQ(v.entries, expected);
  EXPECT_EQ(v.valid, expected);
  EXPECT_TRUE(v.invalid.empty());
  test::remove_tree(scratch);
}

// A cache size cap smaller than the set: each store evicts least recently used entries older than
// a few seconds, and a hit younger than a minute does not refresh its entry, so later compiles of
// a run can evict what earlier jobs of the same run compiled or found. Exit 0 would then be a lie
// (a serving process in no-compile mode would miss): those jobs must fail as "evicted", exit 3.
TEST(SizeCap, EntriesEvictedLaterInTheRunFailIt) {
  unsetenv("MOEJIT_TEMPLATE_DIR");
  unsetenv("MOEJIT_CACHE_MODE");
  unsetenv("MOEJIT_CACHE_MAX_BYTES");
  const std::string scratch = test::make_temp_dir("pc-cap");
  const std::string cache = scratch + "/cache";
  // -j 1: the hidden 64 jobs (hits) run before the hidden 128 compiles that evict them.
  const std::string args = "--json -j 1 --arch sm_90 --dtype bf16 --topk 2" + std::string(kNarrow) +
                           " --cache-dir '" + cache + "' --hidden ";
  test::ToolRun r = test::run_tool(args + "64", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const size_t per_shape = parse_json(r)["compiled"].get<size_t>();
  ASSERT_GT(per_shape, 0u);

  // Last used 30 s ago: old enough to be evicted, too recent for a hit to refresh it.
  namespace fs = std::filesystem;
  size_t backdated = 0;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(cache))
    if (e.is_regular_file() && e.path().extension() == ".moejit") {
      fs::last_write_time(e.path(), fs::file_time_type::clock::now() - std::chrono::seconds(30));
      ++backdated;
    }
  ASSERT_EQ(backdated, per_shape);

  r = test::run_tool(args + "64,128", scratch, "MOEJIT_CACHE_MAX_BYTES=1 ");
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  json j = parse_json(r);
  EXPECT_EQ(j["total"], 2 * per_shape);
  EXPECT_EQ(j["compiled"], per_shape);
  EXPECT_EQ(j["cached"], 0);
  EXPECT_EQ(j["evicted"], per_shape);
  EXPECT_EQ(j["failed"], per_shape);
  std::set<std::string> evicted_keys;
  for (const json& job : j["jobs"]) {
    const bool small = job["spec"].get<std::string>().find(" H=64 ") != std::string::npos;
    EXPECT_EQ(job["status"], small ? "evicted" : "compiled") << job.dump();
    if (!small) continue;
    evicted_keys.insert(job["key"].get<std::string>());
    const std::string error = job.value("error", "");
    EXPECT_NE(error.find("MOEJIT_CACHE_MAX_BYTES"), std::string::npos) << error;
    EXPECT_NE(error.find("1 bytes"), std::string::npos) << error;  // the cap in force
  }
  EXPECT_EQ(evicted_keys.size(), per_shape);
  EXPECT_NE(r.err.find("evicted by the cache size cap"), std::string::npos) << r.err;

  // What the run reported evicted is exactly what a dry run now finds missing.
  r = test::run_tool(args + "64,128 --dry-run", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  j = parse_json(r);
  EXPECT_EQ(j["missing"], per_shape);
  for (const json& job : j["jobs"])
    EXPECT_EQ(job["status"] == "missing", evicted_keys.count(job["key"].get<std::string>()) == 1)
        << job.dump();
  test::remove_tree(scratch);
}

// MOEJIT_LOG_LEVEL set but empty counts as unset, as every other MOEJIT_ variable does; a
// malformed value still warns (which also shows the tool's run reaches the library's logger).
TEST(Environment, AnEmptyLogLevelCountsAsUnset) {
  const std::string scratch = test::make_temp_dir("pc-log-level");
  const std::string args =
      "-q --arch sm_90 --hidden 64 --topk 2 --dtype bf16 --layout "
      "token_major --cache-dir '" +
      scratch + "/cache'";
  test::ToolRun r = test::run_tool(args, scratch, "MOEJIT_LOG_LEVEL='' ");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("MOEJIT_LOG_LEVEL"), std::string::npos) << r.err;
  r = test::run_tool(args, scratch, "MOEJIT_LOG_LEVEL=loud ");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("MOEJIT_LOG_LEVEL=loud is not one of trace, debug, info, warn, error, off"),
            std::string::npos)
      << r.err;
  test::remove_tree(scratch);
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// A cache warmed by root (an image build) and served by another user: the runtime creates it 0700
// / 0600, which the other user cannot open. --readable-by-all opens it for reading and nothing
// else. Run as root where setpriv is available (CI, most containers), the other user really reads
// it: a dry run as nobody finds the entry only afterwards.
TEST(ReadableByAll, AnotherUserReadsACacheWarmedByRoot) {
  const std::string scratch = test::make_temp_dir("pc-readable");
  const std::string cache = scratch + "/cache";
  const std::string args =
      "--arch sm_90 --hidden 64 --topk 2 --dtype bf16 --layout token_major "
      "--cache-dir '" +
      cache + "'";
  test::ToolRun r = test::run_tool(args + " -q", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string key = parse_json(test::run_tool(args + " --json", scratch))["jobs"][0]["key"];
  const std::string v2 = cache + "/" + version_dir_name();
  const std::string shard = v2 + "/" + key.substr(0, 2);
  const std::string entry = shard + "/" + key + ".moejit";
  EXPECT_EQ(mode_of(cache), 0700u);
  EXPECT_EQ(mode_of(shard), 0700u);
  EXPECT_EQ(mode_of(entry), 0600u);
  // What is not an entry keeps its mode: a user's file, and the target of a symlink planted
  // under a key's name (never followed).
  test::write_file(shard + "/notes.txt", "mine");
  ASSERT_EQ(chmod((shard + "/notes.txt").c_str(), 0600), 0);
  test::write_file(scratch + "/elsewhere", "not an entry");
  ASSERT_EQ(chmod((scratch + "/elsewhere").c_str(), 0600), 0);
  const std::string planted = shard + "/" + key.substr(0, 2) + std::string(30, 'f') + ".moejit";
  std::filesystem::create_symlink(scratch + "/elsewhere", planted);

  // Another user must be able to reach the scratch directory (TMPDIR may be private) and run the
  // tool (a checkout under a private home directory is not): probed, else that part is left out.
  bool reachable = true;
  for (std::filesystem::path p = scratch; p.has_relative_path(); p = p.parent_path())
    reachable = reachable && (mode_of(p.parent_path().string()) & S_IXOTH) != 0;
  const std::string as_nobody = "/usr/bin/setpriv --reuid=65534 --regid=65534 --clear-groups ";
  const bool other_user = geteuid() == 0 && access("/usr/bin/setpriv", X_OK) == 0 && reachable &&
                          test::run_tool("--help", scratch, as_nobody).rc == 0;
  ASSERT_EQ(chmod(scratch.c_str(), 0755), 0);  // mkdtemp made it 0700
  if (other_user) {
    r = test::run_tool(args + " --dry-run --json", scratch, as_nobody);
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(parse_json(r)["missing"], 1) << "another user read a 0700 cache";
  }

  r = test::run_tool(args + " --readable-by-all --json", scratch);
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  const json readable = parse_json(r)["readable_by_all"];
  EXPECT_EQ(readable["directories"], 3) << readable.dump();  // cache, v1, the shard
  EXPECT_EQ(readable["entries"], 1) << readable.dump();
  EXPECT_TRUE(readable["failed"].empty()) << readable.dump();
  for (const json& blocked : readable["blocked"])
    EXPECT_EQ(blocked.get<std::string>().find(scratch), std::string::npos) << blocked;
  for (const std::string& dir : {cache, v2, shard}) EXPECT_EQ(mode_of(dir), 0755u);
  EXPECT_EQ(mode_of(entry), 0644u);
  EXPECT_EQ(mode_of(shard + "/notes.txt"), 0600u);
  EXPECT_EQ(mode_of(scratch + "/elsewhere"), 0600u);
  if (other_user) {
    r = test::run_tool(args + " --dry-run --json", scratch, as_nobody);
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(parse_json(r)["cached"], 1) << r.out << r.err;
  } else {
    std::cout << "[ NOTE ] not run as root with setpriv, or another user cannot reach the "
                 "scratch directory or the tool: another user's read was not tried\n";
  }

  // A directory above the cache that others cannot search is reported (not changed).
  ASSERT_EQ(chmod(scratch.c_str(), 0700), 0);
  r = test::run_tool(args + " --readable-by-all", scratch);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("other users cannot search " + scratch + " (mode 0700)"), std::string::npos)
      << r.err;
  EXPECT_EQ(mode_of(scratch), 0700u);

  // It changes permissions: refused with --dry-run and --verify, which change nothing.
  r = test::run_tool(args + " --readable-by-all --dry-run", scratch);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--readable-by-all"), std::string::npos) << r.err;
  r = test::run_tool("--verify --readable-by-all --cache-dir '" + cache + "'", scratch);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--readable-by-all"), std::string::npos) << r.err;
  test::remove_tree(scratch);
}

// A part of the cache --readable-by-all may not change (a shard that is a symlink: never followed)
// is reported, and the run exits 3: another user would still not read what is behind it.
TEST(ReadableByAll, APartItCannotChangeExitsThree) {
  const std::string scratch = test::make_temp_dir("pc-readable-fail");
  const std::string cache = scratch + "/cache";
  const std::string args =
      "--arch sm_90 --hidden 64 --topk 2 --dtype bf16 --layout token_major --cache-dir '" + cache +
      "'";
  test::ToolRun r = test::run_tool(args + " -q", scratch);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string key = parse_json(test::run_tool(args + " --json", scratch))["jobs"][0]["key"];
  const std::string other_shard = key.substr(0, 2) == "ff" ? "fe" : "ff";
  ASSERT_TRUE(std::filesystem::create_directory(scratch + "/elsewhere"));
  ASSERT_EQ(chmod((scratch + "/elsewhere").c_str(), 0700), 0);
  const std::string v2 = cache + "/" + version_dir_name();
  std::filesystem::create_directory_symlink(scratch + "/elsewhere", v2 + "/" + other_shard);

  r = test::run_tool(args + " --readable-by-all --json", scratch);
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  const json readable = parse_json(r)["readable_by_all"];
  ASSERT_EQ(readable["failed"].size(), 1u) << readable.dump();
  EXPECT_NE(readable["failed"][0].get<std::string>().find(v2 + "/" + other_shard),
            std::string::npos)
      << readable.dump();
  EXPECT_EQ(readable["entries"], 1) << readable.dump();  // the rest is still made readable
  EXPECT_EQ(mode_of(scratch + "/elsewhere"), 0700u);     // nothing followed through the link
  test::remove_tree(scratch);
}

}  // namespace
}  // namespace precompile
}  // namespace moejit
