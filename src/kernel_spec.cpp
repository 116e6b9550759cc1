#include "kernel_spec.h"

#include <algorithm>
#include <initializer_list>
#include <sstream>
#include <stdexcept>

#include "../kernel_templates/combine_params.h"
#include "moejit/moejit.h"

namespace moejit {

static_assert(static_cast<int>(Grid::kTokensByChunks) == kGridTokensByChunks &&
                  static_cast<int>(Grid::kFlat) == kGridFlat &&
                  static_cast<int>(Grid::kFlatOrTokensByChunks) == kGridFlatOrTokensByChunks,
              "the host's grid codes are the kernels'");

const char* dtype_name(int dtype) {
  switch (dtype) {
    case MOEJIT_DTYPE_FLOAT32:
      return "fp32";
    case MOEJIT_DTYPE_FLOAT16:
      return "fp16";
    case MOEJIT_DTYPE_BFLOAT16:
      return "bf16";
    case MOEJIT_DTYPE_FLOAT8_E4M3:
      return "fp8";
    default:
      return "unknown";
  }
}

const char* layout_name(int layout) {
  switch (layout) {
    case MOEJIT_LAYOUT_TOKEN_MAJOR:
      return "token_major";
    case MOEJIT_LAYOUT_GATHER_MAP:
      return "gather_map";
    case MOEJIT_LAYOUT_TOKEN_INDEX:
      return "token_index";
    default:
      return "unknown";
  }
}

namespace {

// One row per kind: its name, its layout, and the kernel template its module instantiates.
struct KindInfo {
  KernelKind kind;
  const char* name;
  int layout;
  const char* kernel;  // "" for the list helpers (two kernels)
  const char* header;  // the kernel family's template, which the generated source includes
};

constexpr KindInfo kKinds[kKernelKinds] = {
    {KernelKind::kTokenMajor, "token_major", MOEJIT_LAYOUT_TOKEN_MAJOR, "combine_fixed",
     "combine_fixed.cuh"},
    {KernelKind::kGatherMap, "gather_map", MOEJIT_LAYOUT_GATHER_MAP, "combine_fixed",
     "combine_fixed.cuh"},
    {KernelKind::kGatherMapOneToken, "gather_map_one_token", MOEJIT_LAYOUT_GATHER_MAP,
     "combine_one_token_map", "combine_one_token.cuh"},
    {KernelKind::kTokenIndexLists, "token_index_lists", MOEJIT_LAYOUT_TOKEN_INDEX, "combine_lists",
     "combine_token_index.cuh"},
    {KernelKind::kTokenIndexScan, "token_index_scan", MOEJIT_LAYOUT_TOKEN_INDEX, "combine_scan",
     "combine_token_index.cuh"},
    {KernelKind::kTokenIndexSmallScan, "token_index_small_scan", MOEJIT_LAYOUT_TOKEN_INDEX,
     "combine_scan", "combine_token_index.cuh"},
    {KernelKind::kTokenIndexOneToken, "token_index_one_token", MOEJIT_LAYOUT_TOKEN_INDEX,
     "combine_one_token", "combine_one_token.cuh"},
    {KernelKind::kEpilogueTokenMajor, "token_major_epilogue", MOEJIT_LAYOUT_TOKEN_MAJOR,
     "combine_epilogue", "combine_epilogue.cuh"},
    {KernelKind::kEpilogueGatherMap, "gather_map_epilogue", MOEJIT_LAYOUT_GATHER_MAP,
     "combine_epilogue", "combine_epilogue.cuh"},
    {KernelKind::kEpilogueTokenIndex, "token_index_epilogue", MOEJIT_LAYOUT_TOKEN_INDEX,
     "combine_epilogue", "combine_epilogue.cuh"},
    {KernelKind::kEpilogueClusterTokenMajor, "token_major_epilogue_cluster",
     MOEJIT_LAYOUT_TOKEN_MAJOR, "combine_epilogue_cluster", "combine_epilogue.cuh"},
    {KernelKind::kEpilogueClusterGatherMap, "gather_map_epilogue_cluster", MOEJIT_LAYOUT_GATHER_MAP,
     "combine_epilogue_cluster", "combine_epilogue.cuh"},
    {KernelKind::kEpilogueClusterTokenIndex, "token_index_epilogue_cluster",
     MOEJIT_LAYOUT_TOKEN_INDEX, "combine_epilogue_cluster", "combine_epilogue.cuh"},
    {KernelKind::kTokenIndexListHelpers, "token_index_list_helpers", MOEJIT_LAYOUT_TOKEN_INDEX, "",
     "combine_token_index.cuh"},
};

const KindInfo& info(KernelKind kind) {
  const int i = static_cast<int>(kind);
  return kKinds[i >= 0 && i < kKernelKinds ? i : 0];
}

const char* index_name(int index_bytes) {
  return index_bytes == 8 ? "int64" : "int32";
}

// The epilogue's optional buffers: their dtype, or "none".
const char* optional_dtype_name(int dtype) {
  return dtype < 0 ? "none" : dtype_name(dtype);
}

}  // namespace

const char* kind_name(KernelKind kind) {
  return info(kind).name;
}

const char* kernel_name(KernelKind kind) {
  return kind == KernelKind::kTokenIndexListHelpers ? "token_index_clear/assign"
                                                    : info(kind).kernel;
}

int kind_layout(KernelKind kind) {
  return info(kind).layout;
}

bool holds_rows(KernelKind kind) {
  return kind_layout(kind) == MOEJIT_LAYOUT_TOKEN_INDEX &&
         kind != KernelKind::kTokenIndexListHelpers;
}

bool keeps_lists(KernelKind kind) {
  return holds_rows(kind) && kind != KernelKind::kTokenIndexOneToken;
}

bool after_list_helpers(KernelKind kind) {
  return kind == KernelKind::kTokenIndexLists || kind == KernelKind::kEpilogueTokenIndex ||
         kind == KernelKind::kEpilogueClusterTokenIndex;
}

int heavy_kernel_slot(KernelKind kind) {
  return is_cluster_epilogue(kind) ? kClusterHeavyKernel : kHeavyKernel;
}

bool is_cluster_epilogue(KernelKind kind) {
  return kind == KernelKind::kEpilogueClusterTokenMajor ||
         kind == KernelKind::kEpilogueClusterGatherMap ||
         kind == KernelKind::kEpilogueClusterTokenIndex;
}

bool is_epilogue(KernelKind kind) {
  return is_cluster_epilogue(kind) || kind == KernelKind::kEpilogueTokenMajor ||
         kind == KernelKind::kEpilogueGatherMap || kind == KernelKind::kEpilogueTokenIndex;
}

bool KernelSpec::token_index() const {
  return layout() == MOEJIT_LAYOUT_TOKEN_INDEX;
}

namespace {

// token_index_heavy<IN_DT, OUT_DT, IdxT, HIDDEN, VEC[, FINISH = true]>'s name expression.
std::string heavy_expression(int in_dtype, int out_dtype, const char* idx, int hidden, int vec,
                             bool finish) {
  std::ostringstream e;
  e << "&moejit::token_index_heavy<" << in_dtype << ", " << out_dtype << ", " << idx << ", "
    << hidden << ", " << vec << (finish ? "" : ", false") << ">";
  return e.str();
}

}  // namespace

std::vector<std::string> KernelSpec::name_expressions() const {
  const char* idx = index_bytes == 8 ? "long long" : "int";
  if (kind == KernelKind::kTokenIndexListHelpers)
    return {"&moejit::token_index_clear<>",
            std::string("&moejit::token_index_assign<") + idx + ">"};
  if (is_epilogue(kind)) {
    // combine_epilogue<LAYOUT, IN_DT, OUT_DT, IdxT, HIDDEN, VEC, ROWS, TPT, TPB, UPT, LIST_CAP,
    // SPLIT, RES_DT, W_DT>; the cluster kind's module has its one-block kernel second.
    std::ostringstream args;
    args << "<" << layout() << ", " << in_dtype << ", " << out_dtype << ", " << idx << ", "
         << hidden << ", " << vec << ", " << (token_index() ? held : top_k) << ", " << tpt << ", "
         << tpb << ", " << upt << ", " << list_cap << ", " << split << ", " << res_dtype << ", "
         << weight_dtype << ">";
    std::vector<std::string> names;
    if (is_cluster_epilogue(kind))
      names.push_back("&moejit::combine_epilogue_cluster" + args.str());
    names.push_back("&moejit::combine_epilogue" + args.str());
    // After the list helpers: the heavy tokens' sums, which the epilogue adds itself (no finish;
    // out's dtype, unused then, is the rows').
    if (after_list_helpers(kind))
      names.push_back(heavy_expression(in_dtype, in_dtype, idx, hidden, vec, false));
    return names;
  }
  std::ostringstream e;
  e << "&moejit::" << info(kind).kernel << "<";
  if (!token_index() && kind != KernelKind::kGatherMapOneToken) e << layout() << ", ";
  e << in_dtype << ", " << out_dtype << ", " << idx << ", " << hidden << ", " << vec << ", "
    << (token_index() ? held : top_k) << ", " << tpt << ", " << tpb << ", " << upt;
  if (keeps_lists(kind)) e << ", " << list_cap;
  if (kind == KernelKind::kTokenMajor || kind == KernelKind::kGatherMap ||
      kind == KernelKind::kTokenIndexLists)
    e << ", " << static_cast<int>(grid) << ", " << (cached_rows ? "true" : "false");
  if (kind == KernelKind::kTokenIndexScan || kind == KernelKind::kTokenIndexSmallScan)
    e << ", " << (kind == KernelKind::kTokenIndexSmallScan ? "true" : "false");
  e << ">";
  if (kind != KernelKind::kTokenIndexLists) return {e.str()};
  // The list path's tokens past their lists: a kernel of the same module (kHeavyKernel).
  return {e.str(), heavy_expression(in_dtype, out_dtype, idx, hidden, vec, true)};
}

std::string KernelSpec::source() const {
  // The kernels are instantiated through their name expressions; the source only brings the
  // kernel family's template in. The spec is echoed in a comment so a dumped source says what it
  // was for.
  return "// libmoejit specialization: " + describe() + "\n#include \"" + info(kind).header +
         "\"\n";
}

std::string KernelSpec::describe() const {
  std::ostringstream s;
  s << "kind=" << kind_name(kind);
  if (kind == KernelKind::kTokenIndexListHelpers) {
    s << " idx=" << index_name(index_bytes);
    return s.str();
  }
  s << " in=" << dtype_name(in_dtype) << " out=" << dtype_name(out_dtype)
    << " idx=" << index_name(index_bytes) << " H=" << hidden << " vec=" << vec;
  if (token_index())
    s << " held=" << held;
  else
    s << " K=" << top_k;
  s << " tpt=" << tpt << " tpb=" << tpb << " upt=" << upt;
  if (keeps_lists(kind)) s << " cap=" << list_cap;
  if (is_epilogue(kind))
    s << " split=" << split << " res=" << optional_dtype_name(res_dtype)
      << " weight=" << optional_dtype_name(weight_dtype);
  return s.str();
}

namespace {

[[noreturn]] void refuse(const std::string& field, const std::string& value,
                         const std::string& allowed) {
  throw std::invalid_argument(field + " = " + value + ": " + allowed);
}

int field_int(const std::map<std::string, std::string>& fields, const std::string& key) {
  const std::string& text = fields.at(key);
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size() && v >= -(1ll << 30) && v <= (1ll << 30)) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  refuse(key, "\"" + text + "\"", "expected an integer");
}

int field_dtype(const std::map<std::string, std::string>& fields, const std::string& key) {
  const std::string& text = fields.at(key);
  for (int d : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16})
    if (text == dtype_name(d)) return d;
  refuse(key, "\"" + text + "\"", "expected fp32, fp16 or bf16");
}

// out of an epilogue kind: fp8 as well.
int field_out_dtype(const std::map<std::string, std::string>& fields, bool epilogue) {
  if (epilogue && fields.at("out") == dtype_name(MOEJIT_DTYPE_FLOAT8_E4M3))
    return MOEJIT_DTYPE_FLOAT8_E4M3;
  if (epilogue && fields.at("out") != "fp32" && fields.at("out") != "fp16" &&
      fields.at("out") != "bf16")
    refuse("out", "\"" + fields.at("out") + "\"", "expected fp32, fp16, bf16 or fp8");
  return field_dtype(fields, "out");
}

// res= and weight= of an epilogue kind: a dtype, or none.
int field_optional_dtype(const std::map<std::string, std::string>& fields, const std::string& key) {
  const std::string& text = fields.at(key);
  if (text == "none") return -1;
  for (int d : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16})
    if (text == dtype_name(d)) return d;
  refuse(key, "\"" + text + "\"", "expected none, fp32, fp16 or bf16");
}

int field_index_bytes(const std::map<std::string, std::string>& fields) {
  const std::string& text = fields.at("idx");
  if (text == "int32") return 4;
  if (text == "int64") return 8;
  refuse("idx", "\"" + text + "\"", "expected int32 or int64");
}

// The keys a kind's line has, in describe()'s order.
std::vector<std::string> keys_of(KernelKind kind) {
  if (kind == KernelKind::kTokenIndexListHelpers) return {"kind", "idx"};
  std::vector<std::string> keys{"kind", "in", "out", "idx", "H", "vec"};
  keys.push_back(holds_rows(kind) ? "held" : "K");
  for (const char* k : {"tpt", "tpb", "upt"}) keys.push_back(k);
  if (keeps_lists(kind)) keys.push_back("cap");
  if (is_epilogue(kind))
    for (const char* k : {"split", "res", "weight"}) keys.push_back(k);
  return keys;
}

std::string joined(const std::vector<std::string>& keys) {
  std::string s;
  for (const std::string& k : keys) s += (s.empty() ? "" : " ") + k;
  return s;
}

// The ranges of the template parameters (each bounded first: tpt * tpb must not overflow).
void check_ranges(const KernelSpec& s) {
  auto fail = [](const std::string& field, int value, const std::string& allowed) {
    refuse(field, std::to_string(value), allowed);
  };
  // The widest element a vector access moves (the epilogue also reads the residual and weight).
  int widest = 1;
  for (int d : {s.in_dtype, s.out_dtype, s.res_dtype, s.weight_dtype})
    if (d >= 0)
      widest = std::max(widest, d == MOEJIT_DTYPE_FLOAT32       ? 4
                                : d == MOEJIT_DTYPE_FLOAT8_E4M3 ? 1
                                                                : 2);
  if (s.layout() == MOEJIT_LAYOUT_TOKEN_MAJOR && s.index_bytes != 4)
    fail("idx bytes", s.index_bytes, "the token_major layout has no index; write idx=int32");
  if (s.hidden < 1 || s.hidden > MOEJIT_MAX_HIDDEN_DIM)
    fail("H", s.hidden, "expected 1.." + std::to_string(MOEJIT_MAX_HIDDEN_DIM));
  if ((s.vec != 1 && s.vec != 2 && s.vec != 4 && s.vec != 8) || s.vec * widest > 16)
    fail("vec", s.vec, "expected 1, 2, 4 or 8, at most 16 bytes of the widest dtype");
  if (holds_rows(s.kind)) {
    if (s.held != 1 && s.held != 2 && s.held != 4 && s.held != 8 && s.held != 12 && s.held != 16)
      fail("held", s.held, "the token_index kinds hold 1, 2, 4, 8, 12 or 16 rows per token");
  } else if (s.top_k < 1 || s.top_k > MOEJIT_MAX_TOP_K) {
    fail("K", s.top_k, "expected 1.." + std::to_string(MOEJIT_MAX_TOP_K));
  }
  if (keeps_lists(s.kind) && s.list_cap != 8 && s.list_cap != 16 && s.list_cap != 32 &&
      s.list_cap != 64 && s.list_cap != 128)
    fail("cap", s.list_cap, "the token_index lists take cap 8, 16, 32, 64 or 128");
  if (s.tpt < 4 || s.tpt > 1024)
    fail("tpt", s.tpt, "expected 4..1024, tpt * tpb a multiple of 32 and at most 1024");
  if (s.tpb < 1 || s.tpb > 1024)
    fail("tpb", s.tpb, "expected 1..1024, tpt * tpb a multiple of 32 and at most 1024");
  if (s.tpt * s.tpb > 1024 || (s.tpt * s.tpb) % 32 != 0)
    fail("tpt", s.tpt, "tpt >= 4, tpb >= 1, tpt * tpb a multiple of 32 and at most 1024");
  if (is_epilogue(s.kind)) {
    // The epilogue holds up to 32 slots per thread (a row's slice in registers).
    if (s.upt < 1 || s.upt > 32) fail("upt", s.upt, "the epilogue kinds take upt 1..32");
    const int most = is_cluster_epilogue(s.kind) ? 8 : 64;
    if (s.split < (is_cluster_epilogue(s.kind) ? 2 : 1) || s.split > most)
      fail("split", s.split,
           is_cluster_epilogue(s.kind) ? "a cluster of 2..8 blocks" : "expected 1..64 slices");
  } else if (s.upt != 1 && s.upt != 2 && s.upt != 4) {
    fail("upt", s.upt, "expected 1, 2 or 4");
  }
}

}  // namespace

KernelSpec parse_kernel_spec(const std::map<std::string, std::string>& fields) {
  if (fields.count("kind") == 0)
    throw std::invalid_argument("an exact spec line starts with kind= (the describe() format)");
  KernelSpec s;
  const std::string& kind = fields.at("kind");
  bool known = false;
  std::string kinds;
  for (const KindInfo& k : kKinds) {
    kinds += std::string(kinds.empty() ? "" : ", ") + k.name;
    if (kind == k.name) {
      s.kind = k.kind;
      known = true;
    }
  }
  if (!known) refuse("kind", "\"" + kind + "\"", "expected one of " + kinds);
  const std::vector<std::string> keys = keys_of(s.kind);
  for (const std::string& k : keys)
    if (fields.count(k) == 0)
      throw std::invalid_argument("\"" + k + "\" is missing: a " + kind + " line has exactly " +
                                  joined(keys));
  if (fields.size() != keys.size())
    for (const auto& entry : fields)
      if (std::find(keys.begin(), keys.end(), entry.first) == keys.end())
        throw std::invalid_argument("\"" + entry.first + "\" does not belong: a " + kind +
                                    " line has exactly " + joined(keys));
  s.index_bytes = field_index_bytes(fields);
  if (s.kind == KernelKind::kTokenIndexListHelpers) return s;
  s.in_dtype = field_dtype(fields, "in");
  s.out_dtype = field_out_dtype(fields, is_epilogue(s.kind));
  s.hidden = field_int(fields, "H");
  s.vec = field_int(fields, "vec");
  if (holds_rows(s.kind))
    s.held = field_int(fields, "held");
  else
    s.top_k = field_int(fields, "K");
  s.tpt = field_int(fields, "tpt");
  s.tpb = field_int(fields, "tpb");
  s.upt = field_int(fields, "upt");
  if (keeps_lists(s.kind)) s.list_cap = field_int(fields, "cap");
  if (is_epilogue(s.kind)) {
    s.split = field_int(fields, "split");
    s.res_dtype = field_optional_dtype(fields, "res");
    s.weight_dtype = field_optional_dtype(fields, "weight");
  }
  check_ranges(s);
  return s;
}

bool KernelSpec::operator==(const KernelSpec& o) const {
  return kind == o.kind && in_dtype == o.in_dtype && out_dtype == o.out_dtype &&
         index_bytes == o.index_bytes && hidden == o.hidden && vec == o.vec && top_k == o.top_k &&
         held == o.held && tpt == o.tpt && tpb == o.tpb && upt == o.upt && list_cap == o.list_cap &&
         res_dtype == o.res_dtype && weight_dtype == o.weight_dtype && split == o.split &&
         grid == o.grid && cached_rows == o.cached_rows;
}

std::size_t KernelSpec::hash() const {
  std::size_t h = 1469598103934665603ull;
  for (int v : {static_cast<int>(kind), in_dtype, out_dtype, index_bytes, hidden, vec, top_k, held,
                tpt, tpb, upt, list_cap, res_dtype, weight_dtype, split, static_cast<int>(grid),
                static_cast<int>(cached_rows)})
    h = (h ^ static_cast<std::size_t>(static_cast<unsigned>(v))) * 1099511628211ull;
  return h;
}

}  // namespace moejit
