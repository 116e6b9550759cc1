// Every variant compiles with NVRTC, without a warning, for every architecture we test on: sm_80,
// sm_89, sm_90.
// The matrix covers every layout x dtype pair x index type, with hidden sizes, top_k and vector
// widths rotated through the list so each value appears with several of the others (a full
// cartesian product would take an hour on a two-core CI machine).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "combine_epilogue.h"
#include "combine_plan.h"
#include "error.h"
#include "kernel_store.h"
#include "nvrtc_compiler.h"

namespace moejit {
namespace {

struct Case {
  KernelSpec spec;
  int sm;
};

int max_vec(int in_dtype, int out_dtype) {
  const int widest =
      (in_dtype == MOEJIT_DTYPE_FLOAT32 || out_dtype == MOEJIT_DTYPE_FLOAT32) ? 4 : 2;
  return 16 / widest;
}

// The module of an epilogue call of T tokens (K 8, H 7168, bf16 rows, residual and norm weight,
// fp8 out, 16-byte vectors).
KernelSpec normed_fp8_spec(moejit_layout layout, int64_t tokens) {
  CallShape c;
  c.layout = layout;
  c.in_dtype = MOEJIT_DTYPE_BFLOAT16;
  c.out_dtype = MOEJIT_DTYPE_FLOAT8_E4M3;
  c.res_dtype = c.weight_dtype = MOEJIT_DTYPE_BFLOAT16;
  c.hidden = 7168;
  c.vec = 8;
  c.top_k = 8;
  c.num_tokens = tokens;
  c.num_rows = tokens * 8;
  return choose_kernel(c);
}

// The epilogue's modules (combine_epilogue.cuh): each layout x epilogue (residual; residual +
// norm; residual + norm + fp8; norm alone; fp8 alone) in its prefill (one block per token) and
// decode (split, cluster) variant, with dtype pairs, hidden sizes, vector widths and archs rotated;
// rows long enough for passes; vector widths whose fp8 groups span warps; and the decode cluster
// module with every epilogue for every arch (before sm_90 its one-block kernel is what runs, and
// before sm_89 the fp8 conversion is the integer one).
void append_epilogue_matrix(std::vector<Case>* cases) {
  const int archs[] = {80, 89, 90};
  struct Epilogue {
    int res, weight;
    bool fp8;
  };
  const Epilogue epilogues[] = {{MOEJIT_DTYPE_BFLOAT16, -1, false},
                                {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, false},
                                {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_BFLOAT16, true},
                                {-1, MOEJIT_DTYPE_FLOAT16, false},
                                {-1, -1, true}};
  auto spec = [](int layout, int in, int out, const Epilogue& e, int hidden, int vec,
                 int64_t tokens) {
    CallShape c;
    c.layout = static_cast<moejit_layout>(layout);
    c.in_dtype = static_cast<moejit_dtype>(in);
    c.out_dtype = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : static_cast<moejit_dtype>(out);
    c.res_dtype = e.res;
    c.weight_dtype = e.weight;
    c.hidden = hidden;
    c.vec = vec;
    c.top_k = 8;
    c.num_tokens = tokens;
    c.num_rows = tokens * 8;
    return choose_kernel(c);
  };
  int n = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (const Epilogue& e : epilogues)
      for (const int64_t tokens : {int64_t{4096}, int64_t{1}}) {
        const int in = n % 3, out = (n / 3) % 3;
        const int hidden = tokens == 1 ? (n % 2 ? 7168 : 2880) : (n % 3 ? 4096 : 7);
        const int widest = std::max({in == MOEJIT_DTYPE_FLOAT32 || out == MOEJIT_DTYPE_FLOAT32 ||
                                             e.res == MOEJIT_DTYPE_FLOAT32
                                         ? 4
                                         : 2,
                                     2});
        const int vec = std::min(16 / widest, hidden);
        cases->push_back({spec(layout, in, out, e, hidden, vec, tokens), archs[n % 3]});
        ++n;
      }
  // Passes (H 65536); 1- and 2-element vectors (a group's 128 channels over 4 or 2 warps).
  cases->push_back({spec(1, 2, 2, epilogues[2], 65536, 8, 4096), 90});
  cases->push_back({spec(2, 0, 0, epilogues[3], 65536, 4, 4096), 80});
  cases->push_back({spec(1, 2, 2, epilogues[2], 2880, 1, 4096), 89});
  cases->push_back({spec(0, 1, 1, epilogues[4], 2880, 2, 33), 90});
  // Wide blocks (more than 256 threads), where ptxas has at most 128 registers: the token index's
  // passes in 2-element vectors, and a 512-thread decode split in 1-element ones.
  cases->push_back({spec(2, 0, 0, epilogues[3], 33000, 2, 4096), 89});
  cases->push_back({spec(2, 1, 0, epilogues[0], 2880, 1, 1), 89});
  for (const Epilogue& e : epilogues)
    for (int sm : archs) cases->push_back({spec(1, 2, 2, e, 7168, 8, 1), sm});
  // The token index's modules hold token_index_heavy without its finish, and their kernels add a
  // token past its list from its ranks or pieces: the decode split and one block per token with
  // every epilogue for every arch.
  int m = 0;
  for (const Epilogue& e : epilogues)
    for (int sm : archs) {
      cases->push_back({spec(2, 2, 2, e, 7168, 8, 1), sm});
      const int in = m % 3, out = (m + 1) % 3;
      const int widest =
          in == MOEJIT_DTYPE_FLOAT32 || out == MOEJIT_DTYPE_FLOAT32 || e.res == MOEJIT_DTYPE_FLOAT32
              ? 4
              : 2;
      const int vec = 16 / widest / (m % 4 == 3 ? 2 : 1);
      cases->push_back({spec(2, in, out, e, m % 2 ? 2880 : 7168, vec, 4096), sm});
      ++m;
    }
}

std::vector<Case> matrix() {
  const int hiddens[] = {1, 7, 128, 2880, 4096, 7168};
  const int top_ks[] = {1, 2, 8};
  const int archs[] = {80, 89, 90};
  std::vector<Case> cases;
  int n = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (int in = 0; in < 3; ++in)
      for (int out = 0; out < 3; ++out)
        for (int idx = 0; idx < 2; ++idx) {
          if (layout == MOEJIT_LAYOUT_TOKEN_MAJOR && idx == 1) continue;  // no index
          const int hidden = hiddens[n % 6];
          KernelSpec s =
              spec_for_shape(static_cast<moejit_layout>(layout), static_cast<moejit_dtype>(in),
                             static_cast<moejit_dtype>(out), static_cast<moejit_index_type>(idx),
                             hidden, top_ks[n % 3], 256);
          // Rotate through every vector width the dtype pair allows (misaligned buffers get the
          // narrower ones at run time), not only the widest.
          const int widths = max_vec(in, out) == 8 ? 4 : 3;
          s.vec = std::min(max_vec(in, out) >> (n % widths), std::max(1, hidden));
          finish_spec(&s);
          cases.push_back({s, archs[n % 3]});
          if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
            // The single-launch module as well, in a prefill geometry (one token per block for
            // rows of 128+ vectors: the ballot scan; several per 512-thread block for short
            // rows: the atomic scan and the sort) and in the decode geometry (128-thread blocks
            // where a row fills them, as at prefill but one slot per thread; several tokens per
            // 128-thread block for short rows; one 64-thread group otherwise).
            cases.push_back({single_launch_spec(s, kAnyTokens), archs[(n + 1) % 3]});
            KernelSpec d =
                spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, static_cast<moejit_dtype>(in),
                               static_cast<moejit_dtype>(out), static_cast<moejit_index_type>(idx),
                               hidden, top_ks[n % 3], 1);
            const KernelSpec single_decode = single_launch_spec(d, 1);
            cases.push_back({single_decode, archs[(n + 2) % 3]});
            // Its small-call form, where it lists rows in order (one token per block).
            const KernelSpec small_decode = single_launch_for_rows(single_decode, 1);
            if (small_decode != single_decode) cases.push_back({small_decode, archs[(n + 1) % 3]});
            // And the one-token kernel in its own geometry (8-byte vectors with one or two rows
            // where a row fills 128 threads).
            cases.push_back({one_token_index_spec(d), archs[n % 3]});
          }
          if (layout == MOEJIT_LAYOUT_GATHER_MAP) {
            // The gather map's one-token kernel, in the decode geometry (every row of the call in
            // flight at once, staged in shared memory).
            KernelSpec d =
                spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, static_cast<moejit_dtype>(in),
                               static_cast<moejit_dtype>(out), static_cast<moejit_index_type>(idx),
                               hidden, top_ks[n % 3], 256, 1);
            d.vec = s.vec;
            d.kind = KernelKind::kGatherMapOneToken;
            finish_spec(&d);
            cases.push_back({d, archs[(n + 1) % 3]});
          }
          ++n;
        }
  // Token-index lists longer than the matrix's (its top-k values give at most 32 entries): 64 for
  // 9-16 rows per token on average, 128 past 16 (list_capacity). The single launch keeps them in
  // shared memory, one per token of the block; with short rows many tokens share a block (4-thread
  // groups at H=1: 128 tokens of 128-entry lists took 64 KB and did not compile before
  // choose_geometry bounded them).
  int m = 0;
  for (int hidden : {1, 7, 128})
    for (int rows_per_token : {12, 40}) {
      for (int64_t tokens : {kAnyTokens, int64_t{1}}) {
        const KernelSpec s =
            spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                           MOEJIT_INDEX_INT32, hidden, rows_per_token, 256, tokens);
        cases.push_back({s, archs[m++ % 3]});
        const KernelSpec single = single_launch_spec(s, tokens);
        cases.push_back({single, archs[m++ % 3]});
        const KernelSpec small = single_launch_for_rows(single, 1);
        if (small != single) cases.push_back({small, archs[m++ % 3]});
      }
    }
  // Odd hidden sizes at prefill: rows whose starts allow 2- or 4-byte vectors only, four slots per
  // thread (choose_geometry), eight rows of them per batch (BatchRows), in every layout.
  for (int hidden : {1001, 7169})
    for (const auto& [in, out] : {std::pair{MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16},
                                  std::pair{MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32},
                                  std::pair{MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32}})
      for (int layout = 0; layout < 3; ++layout) {
        const KernelSpec s = spec_for_shape(static_cast<moejit_layout>(layout), in, out,
                                            MOEJIT_INDEX_INT32, hidden, 8, 256);
        EXPECT_EQ(s.upt, 4) << s.describe();
        cases.push_back({s, archs[m++ % 3]});
      }
  // The token index's list helpers (one module per index type), for every arch.
  for (int index_bytes : {4, 8})
    for (int sm : archs) cases.push_back({list_helpers_spec(index_bytes), sm});
  // Every spec also for the other two archs where it is cheap: the H=7168 gather-map bf16 case.
  KernelSpec big = spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                  MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256);
  for (int sm : archs) cases.push_back({big, sm});
  append_epilogue_matrix(&cases);
  return cases;
}

// A kernel store with no disk cache: these tests check compilation, not caching.
struct MemoryStore {
  Settings settings = [] {
    Settings s;
    s.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
    return s;
  }();
  Stats stats;
  KernelStore store{settings, stats};
};

TEST(KernelCompile, MatrixCoversEveryValue) {
  std::set<int> layouts, ins, outs, idx, hid, vec, arch;
  std::set<std::pair<int, int>> pairs;
  for (const Case& c : matrix()) {
    if (c.spec.kind == KernelKind::kTokenIndexListHelpers) continue;  // no shape
    if (is_epilogue(c.spec.kind)) continue;  // its own cases (append_epilogue_matrix)
    layouts.insert(c.spec.layout());
    pairs.insert({c.spec.in_dtype, c.spec.out_dtype});
    idx.insert(c.spec.index_bytes);
    hid.insert(c.spec.hidden);
    vec.insert(c.spec.vec);
    arch.insert(c.sm);
  }
  EXPECT_EQ(layouts.size(), 3u);
  EXPECT_EQ(pairs.size(), 9u);
  EXPECT_EQ(idx.size(), 2u);
  EXPECT_EQ(hid.size(), 8u);  // the six of the rotation, and the odd 1001 and 7169
  EXPECT_EQ(vec, (std::set<int>{1, 2, 4, 8}));
  EXPECT_EQ(arch.size(), 3u);
}

// One kernel's entry in the compiler's resource report (ptxas -v, through NVRTC's log).
struct KernelResources {
  std::string function;
  bool entry = false;  // a kernel; otherwise a device function the kernels call (not inlined)
  int registers = -1, stack_bytes = -1, spill_store_bytes = -1, spill_load_bytes = -1;
};

// Parses lines such as
//   ptxas info    : Compiling entry function '_ZN6moejit7combine...' for 'sm_90'
//   ptxas info    : Function properties for _ZN6moejit7combine...
//   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//   ptxas info    : Used 55 registers, used 0 barriers
// A called device function has its own properties (stack frame, spills) but no register line.
std::vector<KernelResources> parse_resource_report(const std::string& log) {
  std::vector<KernelResources> kernels;
  std::istringstream lines(log);
  std::string line, entry;
  const std::string compiling = "Compiling entry function '",
                    properties = "Function properties for ";
  while (std::getline(lines, line)) {
    size_t at = line.find(compiling);
    if (at != std::string::npos) {
      const size_t begin = at + compiling.size();
      entry = line.substr(begin, line.find('\'', begin) - begin);
      continue;
    }
    at = line.find(properties);
    if (at != std::string::npos) {
      const std::string function = line.substr(at + properties.size());
      kernels.push_back(KernelResources{function, function == entry});
      continue;
    }
    if (kernels.empty()) continue;
    KernelResources& k = kernels.back();
    if (line.find("bytes stack frame") != std::string::npos) {
      const size_t dot = line.find('.');
      std::sscanf(line.c_str() + (dot == std::string::npos ? 0 : dot + 1),
                  " %d bytes stack frame, %d bytes spill stores, %d bytes spill loads",
                  &k.stack_bytes, &k.spill_store_bytes, &k.spill_load_bytes);
    } else if ((at = line.find("Used ")) != std::string::npos) {
      std::sscanf(line.c_str() + at, "Used %d registers", &k.registers);
    }
  }
  return kernels;
}

// "combine" from "_ZN6moejit7combineILi2E...": the template's name in a mangled kernel name.
std::string template_name(const std::string& mangled) {
  const std::string ns = "_ZN6moejit";
  if (mangled.compare(0, ns.size(), ns) != 0) return mangled;
  size_t length = 0, at = ns.size();
  while (at < mangled.size() && std::isdigit(static_cast<unsigned char>(mangled[at])))
    length = length * 10 + static_cast<size_t>(mangled[at++] - '0');
  return mangled.substr(at, length);
}

TEST(KernelCompile, ResourceReportParses) {
  const std::string log =
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function '_Z1fv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z1fv\n"
      "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 55 registers, used 0 barriers\n"
      "ptxas info    : Compiling entry function '_Z1gv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z1gv\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 16 registers, used 1 barriers, 380 bytes cmem[0]\n"
      "ptxas info    : Function properties for _Z1hv\n"
      "ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
  const std::vector<KernelResources> k = parse_resource_report(log);
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(k[0].function, "_Z1fv");
  EXPECT_TRUE(k[0].entry);
  EXPECT_EQ(k[0].registers, 55);
  EXPECT_EQ(k[0].stack_bytes, 8);
  EXPECT_EQ(k[0].spill_store_bytes, 4);
  EXPECT_EQ(k[0].spill_load_bytes, 12);
  EXPECT_TRUE(k[1].entry);
  EXPECT_EQ(k[1].registers, 16);
  EXPECT_EQ(k[1].stack_bytes, 0);
  EXPECT_EQ(k[2].function, "_Z1hv");  // a called function: no register line
  EXPECT_FALSE(k[2].entry);
  EXPECT_EQ(k[2].registers, -1);
  EXPECT_EQ(k[2].stack_bytes, 16);
  EXPECT_EQ(template_name("_ZN6moejit12combine_scanILi2ELi2EiLi7168EEEvNS_13CombineParamsE"),
            "combine_scan");
}

// Also the compiler's resource report for every kernel of every variant (the issue's "check
// registers and spills"): a spill or a stack frame puts local-memory traffic into the loop that
// streams the rows, so either fails the test. The report is asked for in this test only (-v
// changes no code, but it would change every cache key and grow every stored log).
TEST(KernelCompile, EveryVariantCompilesForSm80Sm89Sm90) {
  MemoryStore memory;
  KernelStore& store = memory.store;
  const std::vector<Case> cases = matrix();
  std::atomic<size_t> next{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  std::map<std::string, int> most_registers;  // per kernel template and layout
  auto worker = [&] {
    for (size_t i = next++; i < cases.size(); i = next++) {
      const Case& c = cases[i];
      try {
        CompileRequest request = store.request_for(c.spec, Target{c.sm, false});
        request.options.push_back("--ptxas-options=-v");
        const CompiledModule m = compile(request);
        if (m.image.size() < 1000 || m.lowered_names.size() != c.spec.name_expressions().size())
          throw Error(MOEJIT_ERROR_INTERNAL, "empty cubin or missing lowered names");
        // The templates compile cleanly: a warning here is a finding (and its text would be
        // stored in every cache entry).
        if (m.log.find("warning") != std::string::npos)
          throw Error(MOEJIT_ERROR_INTERNAL, "NVRTC warned:\n" + m.log);
        const std::vector<KernelResources> report = parse_resource_report(m.log);
        const auto kernels = std::count_if(report.begin(), report.end(),
                                           [](const KernelResources& k) { return k.entry; });
        if (kernels != static_cast<long>(m.lowered_names.size()))
          throw Error(MOEJIT_ERROR_INTERNAL, "resource report for " + std::to_string(kernels) +
                                                 " of " + std::to_string(m.lowered_names.size()) +
                                                 " kernels:\n" + m.log);
        // Every function, the called ones too (a kernel may call a __noinline__ one): no stack,
        // no spill.
        for (const KernelResources& k : report) {
          if ((k.entry && k.registers <= 0) || k.stack_bytes != 0 || k.spill_store_bytes != 0 ||
              k.spill_load_bytes != 0)
            throw Error(MOEJIT_ERROR_INTERNAL,
                        k.function + ": " + std::to_string(k.registers) + " registers, " +
                            std::to_string(k.stack_bytes) + " bytes stack, " +
                            std::to_string(k.spill_store_bytes) + "/" +
                            std::to_string(k.spill_load_bytes) + " bytes spilled");
          if (!k.entry) continue;
          const std::string kind = template_name(k.function) + " (" + kind_name(c.spec.kind) + ")";
          std::lock_guard<std::mutex> lock(failures_mutex);
          most_registers[kind] = std::max(most_registers[kind], k.registers);
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(failures_mutex);
        failures.push_back(c.spec.describe() + " sm_" + std::to_string(c.sm) + ": " + e.what());
      }
    }
  };
  std::vector<std::thread> threads;
  const unsigned n = std::max(2u, std::thread::hardware_concurrency());
  for (unsigned t = 0; t < n; ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_GE(cases.size(), 45u);
  for (const auto& [kind, registers] : most_registers)
    std::printf("most registers: %-40s %d\n", kind.c_str(), registers);
}

// The PTX of one kernel of a module: from its .entry to the next (empty, and a failure, if the
// module has no kernel of that template).
std::string entry_of(const std::string& ptx, const std::string& kernel) {
  const size_t at = ptx.find(".entry _ZN6moejit" + std::to_string(kernel.size()) + kernel);
  EXPECT_NE(at, std::string::npos) << kernel;
  if (at == std::string::npos) return std::string();
  const size_t next = ptx.find(".entry", at + 1);
  return ptx.substr(at, next == std::string::npos ? std::string::npos : next - at);
}

// The fixed layouts' 128-thread blocks with one slot per thread promise ptxas eight blocks per SM
// (combine_fixed.cuh, FixedMinBlocks): without it ptxas fitted them into 32 registers by issuing a
// batch's row loads one or two at a time. The gather map's four-slot blocks (K=2 at prefill)
// promise ten, which keeps them at 48 registers (56 without it since the bf16 word unpack); with
// 9-16 rows per token, all in one batch (kWideBatch), four (up to 128 registers). Every
// other block keeps ptxas's own choice (the token index, token-major's mid-size 16x2 blocks and the
// gather map's one-token kernel are tuned without it; the gather map's mid-size blocks are 16x8,
// 128 threads, and promise eight). Read from the PTX, where the promise is the
// .minnctapersm directive.
TEST(KernelCompile, LaunchBoundsPromiseBlocksPerSmOnlyWhereMeasured) {
  MemoryStore memory;
  struct Expect {
    KernelSpec spec;
    int promise;  // blocks per SM, 0: none
  };
  auto shape = [](moejit_layout layout, moejit_dtype dtype, int hidden, int top_k, int64_t tokens) {
    return spec_for_shape(layout, dtype, dtype, MOEJIT_INDEX_INT32, hidden, top_k, 256, tokens);
  };
  const Expect cases[] = {
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 8, kAnyTokens), 8},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 9, kAnyTokens), 4},
      {shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_BFLOAT16, 2048, 16, 1), 4},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 17, kAnyTokens), 8},
      {shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_BFLOAT16, 4096, 2, kAnyTokens), 8},
      {shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32, 128, 2, kAnyTokens), 8},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 4096, 2, kAnyTokens), 10},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_FLOAT32, 4096, 2, kAnyTokens), 10},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 5120, 1, kAnyTokens), 0},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 8, 1), 8},     // = prefill
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 8, 512), 8},   // 16x8
      {shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_BFLOAT16, 7168, 8, 512), 0},  // 16x2
      {one_token_map_spec(shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 7168, 8, 1)), 0},
      {shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, 7168, 8, kAnyTokens), 0},
      // Odd hidden sizes: 2-byte vectors, four slots per thread, eight blocks.
      {shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT16, 7169, 8, kAnyTokens), 8},
      {shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, 1001, 2, kAnyTokens), 8},
  };
  for (const Expect& c : cases) {
    SCOPED_TRACE(c.spec.describe());
    // The geometry each case stands for (a change in choose_geometry must revisit this test).
    const bool fixed_128 = c.spec.tpt * c.spec.tpb == 128 && !c.spec.token_index();
    const bool wide_batch = c.spec.top_k > 8 && c.spec.top_k <= 16;
    const int vector_bytes = c.spec.vec * (c.spec.in_dtype == MOEJIT_DTYPE_FLOAT32 ? 4 : 2);
    const int geometry_promise = !fixed_128          ? 0
                                 : c.spec.upt == 1   ? (wide_batch ? 4 : 8)
                                 : vector_bytes <= 4 ? 8
                                 : c.spec.upt == 4 && c.spec.layout() == MOEJIT_LAYOUT_GATHER_MAP
                                     ? 10
                                     : 0;
    EXPECT_EQ(geometry_promise, c.promise);
    const CompiledModule m = compile(memory.store.request_for(c.spec, Target{90, true}));
    // The combine's own entry (the list path's module also has token_index_heavy, which
    // promises two blocks of its own).
    const std::string combine = c.spec.token_index() ? entry_of(m.image, "combine_lists") : m.image;
    const std::string directive = ".minnctapersm " + std::to_string(c.promise);
    const size_t first = combine.find(".minnctapersm");
    if (c.promise == 0) {
      EXPECT_EQ(first, std::string::npos);
    } else {
      EXPECT_NE(first, std::string::npos);
      EXPECT_EQ(first, combine.find(directive));
    }
  }
}

// Programmatic dependent launch (docs/performance.md#dependent-launch): a call's first kernel asks
// L2 for its routing before it waits (prefetch.global.L2, then griddepcontrol.wait); no combine
// kernel lets the caller's next kernel start early (griddepcontrol.launch_dependents from a short
// kernel slowed the caller's next kernel); the list helpers do trigger, since their dependents are
// the chain's own next kernels. Read from the PTX.
TEST(KernelCompile, DependentLaunchPrefetchesRoutingAndLeavesTheNextKernelAlone) {
  MemoryStore memory;
  auto ptx_for = [&](const KernelSpec& spec, int arch) {
    return compile(memory.store.request_for(spec, Target{arch, true})).image;
  };
  auto ptx = [&](const KernelSpec& spec) { return ptx_for(spec, 90); };
  // Nothing the previous kernel may have written is read before the wait: in each kernel that
  // waits, no load of any kind (ld.global, ld.global.nc) comes between its entry and the wait.
  // Only the code's shape keeps them there: the row loads' asm and __ldg are not volatile
  // (combine_common.cuh, load_pack_if).
  auto expect_no_load_before_the_wait = [](const std::string& code) {
    int waiting_kernels = 0;
    for (size_t entry = code.find(".entry"); entry != std::string::npos;
         entry = code.find(".entry", entry + 1)) {
      const size_t next_entry = code.find(".entry", entry + 1);
      const size_t wait = code.find("griddepcontrol.wait", entry);
      if (wait == std::string::npos || wait > next_entry) continue;
      const size_t load = code.find("ld.global", entry);
      EXPECT_GT(load, wait) << code.substr(load, 120);
      ++waiting_kernels;
    }
    EXPECT_GE(waiting_kernels, 1);
  };
  auto shape = [](moejit_layout layout, int hidden, int top_k, int64_t tokens) {
    return spec_for_shape(layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32,
                          hidden, top_k, 256, tokens);
  };
  auto normed = normed_fp8_spec;
  const KernelSpec decode_index = shape(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, 1);
  const KernelSpec single = single_launch_spec(decode_index, 1);
  ASSERT_EQ(single_launch_for_rows(single, 1).kind, KernelKind::kTokenIndexSmallScan);
  KernelSpec decode_one = decode_index;  // the one-token kernel in the decode geometry
  decode_one.kind = KernelKind::kTokenIndexOneToken;
  decode_one.list_cap = 0;
  finish_spec(&decode_one);
  KernelSpec map_one = shape(MOEJIT_LAYOUT_GATHER_MAP, 7168, 8, 1);
  map_one.kind = KernelKind::kGatherMapOneToken;
  finish_spec(&map_one);
  const KernelSpec first_kernels[] = {
      shape(MOEJIT_LAYOUT_GATHER_MAP, 7168, 8, 1),           // decode geometry
      shape(MOEJIT_LAYOUT_GATHER_MAP, 4096, 2, kAnyTokens),  // prefill geometry
      shape(MOEJIT_LAYOUT_TOKEN_MAJOR, 7168, 8, 1),
      single,                             // one token per block, lists in shared memory
      single_launch_for_rows(single, 1),  // the small-call form
      decode_one,
      one_token_index_spec(shape(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 2, 1)),  // 8-byte vectors
      one_token_index_spec(decode_index),                                  // 4-byte vectors
      map_one,
      single_launch_spec(shape(MOEJIT_LAYOUT_TOKEN_INDEX, 128, 2, kAnyTokens), kAnyTokens),
      // The epilogue's (combine_epilogue.cuh): one block per token, and the decode split (its
      // module's cluster kernel and one-block kernel).
      normed(MOEJIT_LAYOUT_GATHER_MAP, 4096),
      normed(MOEJIT_LAYOUT_GATHER_MAP, 1),
      normed(MOEJIT_LAYOUT_TOKEN_MAJOR, 1),
  };
  for (const KernelSpec& spec : first_kernels) {
    SCOPED_TRACE(spec.describe());
    const std::string code = ptx(spec);
    const size_t prefetch = code.find("prefetch.global.L2");
    const size_t wait = code.find("griddepcontrol.wait");
    EXPECT_NE(prefetch, std::string::npos);
    EXPECT_NE(wait, std::string::npos);
    EXPECT_LT(prefetch, wait);  // the hint goes out while the previous kernel drains
    expect_no_load_before_the_wait(code);
    SCOPED_TRACE("compute_100");
    expect_no_load_before_the_wait(ptx_for(spec, 100));
    EXPECT_EQ(code.find("griddepcontrol.launch_dependents"), std::string::npos);
  }
  // The list path's module: its combine waits for token_index_heavy and triggers nothing either;
  // token_index_heavy (the same module) waits for token_index_assign and lets the combine be
  // scheduled early, as the helpers do.
  const std::string list_module = ptx(shape(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, kAnyTokens));
  expect_no_load_before_the_wait(list_module);
  const std::string list_combine = entry_of(list_module, "combine_lists");
  EXPECT_NE(list_combine.find("griddepcontrol.wait"), std::string::npos);
  EXPECT_EQ(list_combine.find("griddepcontrol.launch_dependents"), std::string::npos);
  const std::string heavy = entry_of(list_module, "token_index_heavy");
  EXPECT_NE(heavy.find("griddepcontrol.wait"), std::string::npos);
  EXPECT_NE(heavy.find("griddepcontrol.launch_dependents"), std::string::npos);
  // So does the token index's epilogue (one block per token, and the decode split with its
  // one-block kernel), after the same helpers and its module's own token_index_heavy (without the
  // finish), which waits and lets the epilogue be scheduled early as the list path's does.
  for (const int64_t tokens : {int64_t{4096}, int64_t{1}}) {
    const KernelSpec spec = normed(MOEJIT_LAYOUT_TOKEN_INDEX, tokens);
    SCOPED_TRACE(spec.describe());
    const std::string index_epilogue = ptx(spec);
    expect_no_load_before_the_wait(index_epilogue);
    std::vector<std::string> combines{"combine_epilogue"};
    if (is_cluster_epilogue(spec.kind)) combines.push_back("combine_epilogue_cluster");
    for (const std::string& kernel : combines) {
      const std::string combine = entry_of(index_epilogue, kernel);
      EXPECT_NE(combine.find("griddepcontrol.wait"), std::string::npos) << kernel;
      EXPECT_EQ(combine.find("griddepcontrol.launch_dependents"), std::string::npos) << kernel;
    }
    const std::string epilogue_heavy = entry_of(index_epilogue, "token_index_heavy");
    EXPECT_NE(epilogue_heavy.find("griddepcontrol.wait"), std::string::npos);
    EXPECT_NE(epilogue_heavy.find("griddepcontrol.launch_dependents"), std::string::npos);
  }
  // Its helpers let the chain's next kernel be scheduled early, each of them.
  const std::string helpers = ptx(list_helpers_spec(decode_index.index_bytes));
  size_t triggers = 0;
  for (size_t at = helpers.find("griddepcontrol.launch_dependents"); at != std::string::npos;
       at = helpers.find("griddepcontrol.launch_dependents", at + 1))
    ++triggers;
  EXPECT_EQ(triggers, 2u);
}

// The epilogue's decode split exchanges the sum of squares through distributed shared memory
// between a cluster's blocks on sm_90 (barrier.cluster, mapa, ld.shared::cluster); its module's
// cluster kernel traps before sm_90, where its one-block kernel runs instead. fp8 uses the
// hardware conversion from sm_89 (cvt ... satfinite.e4m3x2), the integer one before. Every fp32
// operation of the norm is an explicitly rounded one (add.rn, mul.rn, div.rn, sqrt.rn): fused,
// the results would differ from moejit.h's.
TEST(KernelCompile, TheEpilogueUsesClustersAndFp8ConversionsWhereTheGpuHasThem) {
  MemoryStore memory;
  const KernelSpec split = normed_fp8_spec(MOEJIT_LAYOUT_GATHER_MAP, 1);
  ASSERT_EQ(split.kind, KernelKind::kEpilogueClusterGatherMap);
  ASSERT_EQ(split.name_expressions().size(), 2u);
  auto ptx = [&](int arch) {
    return compile(memory.store.request_for(split, Target{arch, true})).image;
  };
  const std::string sm90 = ptx(90), sm89 = ptx(89), sm80 = ptx(80);
  for (const char* op :
       {"barrier.cluster.arrive.relaxed", "barrier.cluster.arrive.release",
        "barrier.cluster.wait.acquire", "mapa.shared::cluster", "st.shared::cluster.f32"}) {
    EXPECT_NE(sm90.find(op), std::string::npos) << op;
    EXPECT_EQ(sm89.find(op), std::string::npos) << op;
    EXPECT_EQ(sm80.find(op), std::string::npos) << op;
  }
  EXPECT_NE(sm89.find("trap"), std::string::npos);
  EXPECT_NE(sm90.find("cvt.rn.satfinite.e4m3x2.f32"), std::string::npos);
  EXPECT_NE(sm89.find("cvt.rn.satfinite.e4m3x2.f32"), std::string::npos);
  EXPECT_EQ(sm80.find("e4m3"), std::string::npos);
  for (const std::string* code : {&sm90, &sm89, &sm80})
    for (const char* op : {"sqrt.rn.f32", "div.rn.f32", "mul.rn.f32", "add.rn.f32", "fma.rn.f32"})
      EXPECT_NE(code->find(op), std::string::npos) << op;
}

// token_index_heavy.cuh's hook for a kernel after token_index_heavy that needs a heavy token's fp32
// sum (an epilogue: token_index_heavy without its finish step, FINISH = false, then
// add_heavy_token in that kernel's own geometry). The token index's epilogue modules use both
// (EveryVariantCompilesForSm80Sm89Sm90 compiles them); this probe keeps the hook itself covered in
// a whole-row geometry (512-thread groups, two slots each) and a warp's, for two dtypes; compiled
// for sm_90 without a warning, a spill or a stack frame.
TEST(KernelCompile, HeavyTokenSumForAnEpilogueCompiles) {
  MemoryStore memory;
  CompileRequest r = memory.store.request_for(
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                     MOEJIT_INDEX_INT32, 7168, 8, 256),
      Target{90, false});
  r.source += R"(
namespace moejit {
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT>
__global__ void __launch_bounds__(TPT) epilogue_probe(const CombineParams p, float* sums) {
  const long long heavy = static_cast<long long>(*detail::heavy_counters(p));
  const detail::HeavyWork s = detail::heavy_work<HIDDEN>(p, heavy);
  if (blockIdx.x == 0)
    detail::do_heavy_work<IN_DT, IN_DT, int, HIDDEN, VEC, 1, 4, false>(p, s);
  float sum[UPT][VEC];
  detail::clear_sums(sum);
  const long long tok = s.heavy_tokens[blockIdx.y];
  detail::add_heavy_token<IN_DT, VEC, HIDDEN, UPT, TPT, 4>(
      p, s, tok, p.token_counts[tok], static_cast<int>(threadIdx.x), sum);
  for (int u = 0; u < UPT; ++u)
    for (int e = 0; e < VEC; ++e) sums[(u * TPT + threadIdx.x) * VEC + e] = sum[u][e];
}
}  // namespace moejit
)";
  r.name_expressions = {"&moejit::epilogue_probe<2, 8, 7168, 2, 512>",
                        "&moejit::epilogue_probe<0, 4, 2048, 1, 32>"};
  r.options.push_back("--ptxas-options=-v");
  const CompiledModule m = compile(r);
  EXPECT_EQ(m.log.find("warning"), std::string::npos) << m.log;
  const std::vector<KernelResources> report = parse_resource_report(m.log);
  EXPECT_GE(report.size(), 2u);
  for (const KernelResources& k : report) {
    EXPECT_EQ(k.stack_bytes, 0) << k.function;
    EXPECT_EQ(k.spill_store_bytes, 0) << k.function;
  }
}

TEST(KernelCompile, CompileErrorCarriesTheLog) {
  MemoryStore memory;
  KernelStore& store = memory.store;
  CompileRequest r =
      store.request_for(spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32,
                                       MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32, 128, 2, 256),
                        Target{90, false});
  r.source += "\nthis is not C++;\n";
  try {
    compile(r);
    FAIL() << "expected a compile error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_COMPILE);
    EXPECT_NE(std::string(e.what()).find("log:"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("--gpu-architecture=sm_90"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("error"), std::string::npos);
  }
}

TEST(KernelCompile, TargetsFollowWhatNvrtcSupports) {
  EXPECT_EQ(target_for_device(90).name(), "sm_90");
  // A GPU newer than this NVRTC knows gets PTX of the newest arch NVRTC supports.
  const Target future = target_for_device(990);
  EXPECT_TRUE(future.ptx);
  EXPECT_EQ(future.sm, nvrtc_supported_archs().back());
  // Older than every supported arch: a clear "unsupported".
  try {
    target_for_device(30);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("sm_90"), std::string::npos);
  }
}

TEST(KernelCompile, PtxTargetProducesPtxText) {
  MemoryStore memory;
  KernelStore& store = memory.store;
  const CompiledModule m = compile(
      store.request_for(spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32,
                                       MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32, 128, 2, 256),
                        Target{90, true}));
  EXPECT_NE(m.image.find(".target sm_90"), std::string::npos);
}

}  // namespace
}  // namespace moejit
