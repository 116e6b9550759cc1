#include "precompile_inputs.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace moejit {
namespace precompile {
namespace {

using nlohmann::json;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return std::string();
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(trim(part));
  return parts;
}

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw InputError(std::string(what) + " \"" + path +
                     "\" cannot be read: no such file, or "
                     "no permission");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) throw InputError(std::string(what) + " \"" + path + "\" could not be read");
  return bytes.str();
}

// Nested configs are searched in this order after the top level: the language model of
// multimodal and composite models first, so a vision tower's hidden_size is never taken for the
// model's.
const std::vector<std::string>& preferred_nested() {
  static const std::vector<std::string> names{"text_config", "language_config", "llm_config",
                                              "language_model_config", "thinker_config"};
  return names;
}

struct Candidate {
  const json* object;
  std::string prefix;                  // "" or "text_config."
  std::vector<const json*> ancestors;  // nearest last
};

// Objects of the config, breadth first (top level, then nested configs in preferred order), to a
// depth that covers every layout seen in published configs.
std::vector<Candidate> candidates(const json& root) {
  std::vector<Candidate> out{{&root, "", {}}};
  for (size_t i = 0; i < out.size(); ++i) {
    const Candidate c = out[i];
    if (c.ancestors.size() >= 3) continue;
    std::vector<std::string> keys;
    for (const std::string& k : preferred_nested())
      if (c.object->contains(k) && (*c.object)[k].is_object()) keys.push_back(k);
    for (auto it = c.object->begin(); it != c.object->end(); ++it)
      if (it->is_object() && std::find(keys.begin(), keys.end(), it.key()) == keys.end())
        keys.push_back(it.key());
    for (const std::string& k : keys) {
      Candidate child{&(*c.object)[k], c.prefix + k + ".", c.ancestors};
      child.ancestors.push_back(c.object);
      out.push_back(child);
    }
  }
  return out;
}

int positive_int(const json& value, const std::string& path, const std::string& field) {
  if (value.is_number_integer() || value.is_number_unsigned()) {
    const long long v = value.get<long long>();
    if (v > 0 && v <= 1 << 30) return static_cast<int>(v);
  }
  throw InputError(path + ": field " + field + " = " + value.dump() +
                   ": expected a positive integer");
}

const char* kShapeHelp = "pass the shape explicitly with --hidden and --topk";

// A top-k field: an integer, or one per layer (Hunyuan's moe_topk) that must all be the same.
int top_k_value(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_array() || value.empty()) return positive_int(value, path, field);
  const int k = positive_int(value[0], path, field + "[0]");
  for (size_t i = 1; i < value.size(); ++i)
    if (positive_int(value[i], path, field + "[" + std::to_string(i) + "]") != k)
      throw InputError(path + ": field " + field + " = " + value.dump() +
                       ": the top-k differs between layers; " + kShapeHelp + " (a comma list)");
  return k;
}

const std::string kPlainTopK = "top_k";

void add_unique(const KernelSpec& spec, std::vector<KernelSpec>* specs) {
  if (std::find(specs->begin(), specs->end(), spec) == specs->end()) specs->push_back(spec);
}

int parse_int(const std::string& text, const std::string& where) {
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size() && v >= -(1ll << 30) && v <= (1ll << 30)) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  throw InputError(where + " = \"" + text + "\": expected an integer");
}

// One exact spec from describe()'s key=value fields: parsed and range-checked by
// parse_kernel_spec, its kernel rules set by the dispatch table (finish_spec), and refused where
// the table's kernels cannot run it (check_spec). A consistent spec that the runtime happens not to
// pick merely costs one compile.
KernelSpec exact_spec(const std::map<std::string, std::string>& kv, const std::string& where) {
  KernelSpec s;
  try {
    s = parse_kernel_spec(kv);
  } catch (const std::invalid_argument& e) {
    throw InputError(where + ": " + e.what());
  }
  finish_spec(&s);
  const std::string refused = check_spec(s);
  if (!refused.empty()) throw InputError(where + ": " + refused);
  return s;
}

}  // namespace

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::kResidual:
      return "residual";
    case Epilogue::kNorm:
      return "norm";
    case Epilogue::kNormFp8:
      return "norm-fp8";
    default:
      return "none";
  }
}

Epilogue parse_epilogue(const std::string& text, const std::string& where) {
  const std::string t = lower(trim(text));
  for (Epilogue e : {Epilogue::kNone, Epilogue::kResidual, Epilogue::kNorm, Epilogue::kNormFp8})
    if (t == epilogue_name(e)) return e;
  throw InputError(where + " = \"" + text +
                   "\": unknown epilogue; expected none, residual, norm or norm-fp8");
}

std::vector<Epilogue> config_epilogues(const ModelConfig& cfg) {
  std::vector<Epilogue> list{Epilogue::kNone};
  if (!cfg.rms_norm_field.empty()) {
    list.push_back(Epilogue::kNorm);
    if (!cfg.fp8_field.empty()) list.push_back(Epilogue::kNormFp8);
  }
  return list;
}

moejit_dtype parse_dtype(const std::string& text, const std::string& where) {
  std::string t = lower(trim(text));
  if (t.rfind("torch.", 0) == 0) t = t.substr(6);
  if (t == "fp32" || t == "float32" || t == "float") return MOEJIT_DTYPE_FLOAT32;
  if (t == "fp16" || t == "float16" || t == "half") return MOEJIT_DTYPE_FLOAT16;
  if (t == "bf16" || t == "bfloat16") return MOEJIT_DTYPE_BFLOAT16;
  throw InputError(where + " = \"" + text +
                   "\": unknown dtype; expected fp32, fp16 or bf16 (or float32, float16, half, "
                   "bfloat16)");
}

moejit_layout parse_layout(const std::string& text, const std::string& where) {
  const std::string t = lower(trim(text));
  for (moejit_layout l : all_layouts())
    if (t == layout_name(l)) return l;
  throw InputError(where + " = \"" + text +
                   "\": unknown layout; expected token_major, gather_map or token_index");
}

moejit_index_type parse_index_type(const std::string& text, const std::string& where) {
  const std::string t = lower(trim(text));
  if (t == "int32") return MOEJIT_INDEX_INT32;
  if (t == "int64") return MOEJIT_INDEX_INT64;
  throw InputError(where + " = \"" + text + "\": unknown index type; expected int32 or int64");
}

const std::vector<std::string>& top_k_field_names() {
  static const std::vector<std::string> names{
      "num_experts_per_tok",   "moe_top_k",        "moe_topk", "moe_k",
      "num_experts_per_token", "experts_per_token"};
  return names;
}

const std::vector<std::string>& expert_count_field_names() {
  static const std::vector<std::string> names{"num_experts", "num_local_experts",
                                              "n_routed_experts", "moe_num_experts"};
  return names;
}

namespace {

// Whether obj names a positive expert count (a dense config may carry "num_experts": null or 0).
bool has_expert_count(const json& obj) {
  for (const std::string& name : expert_count_field_names()) {
    if (!obj.contains(name)) continue;
    const json& v = obj[name];
    if ((v.is_number_integer() || v.is_number_unsigned()) && v.get<long long>() > 0) return true;
  }
  return false;
}

// The top-k fields obj holds, in the order they are read: the MoE-specific ones; failing those, a
// plain top_k, but only next to an expert count. Elsewhere top_k is the sampling setting (50 by
// default, written by full config dumps), ignored and never compared with the others.
std::vector<std::string> top_k_fields_of(const json& obj) {
  std::vector<std::string> fields;
  for (const std::string& name : top_k_field_names())
    if (obj.contains(name)) fields.push_back(name);
  if (fields.empty() && obj.contains(kPlainTopK) && has_expert_count(obj))
    fields.push_back(kPlainTopK);
  return fields;
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!root.is_object()) throw InputError(path + ": expected a JSON object (a config.json)");

  const std::vector<Candidate> objects = candidates(root);
  const Candidate* model = nullptr;
  const Candidate* hidden_only = nullptr;
  std::string hidden_name;  // hidden_size, or DBRX's d_model
  // Where the top-k fields sit: the model's object itself, or one of its direct members that has
  // no hidden size of its own (DBRX: d_model at the top, moe_top_k in ffn_config).
  const json* top_k_object = nullptr;
  std::string top_k_prefix;
  for (const Candidate& c : objects) {
    const char* name = c.object->contains("hidden_size") ? "hidden_size"
                       : c.object->contains("d_model")   ? "d_model"
                                                         : nullptr;
    if (name == nullptr) continue;
    if (hidden_only == nullptr) {
      hidden_only = &c;
      hidden_name = name;
    }
    if (!top_k_fields_of(*c.object).empty()) {
      model = &c;
      top_k_object = c.object;
      top_k_prefix = c.prefix;
    } else {
      for (auto it = c.object->begin(); it != c.object->end() && model == nullptr; ++it) {
        if (!it->is_object() || it->contains("hidden_size") || it->contains("d_model") ||
            top_k_fields_of(*it).empty())
          continue;
        model = &c;
        top_k_object = &*it;
        top_k_prefix = c.prefix + it.key() + ".";
      }
    }
    if (model != nullptr) {
      hidden_name = name;
      break;
    }
  }
  auto join = [](const std::vector<std::string>& list) {
    std::string out;
    for (size_t i = 0; i < list.size(); ++i)
      out += (i == 0 ? "" : i + 1 == list.size() ? " or " : ", ") + list[i];
    return out;
  };
  if (hidden_only == nullptr)
    throw InputError(path +
                     ": missing field hidden_size (or d_model; looked at the top level and in "
                     "nested configs such as text_config); " +
                     kShapeHelp);
  if (model == nullptr) {
    const std::string note = hidden_only->object->contains(kPlainTopK)
                                 ? " (" + hidden_only->prefix + kPlainTopK +
                                       " without an expert count is taken for the sampling setting)"
                                 : std::string();
    throw InputError(path + ": missing the top-k field (expected one of " +
                     join(top_k_field_names()) + " next to " + hidden_only->prefix + hidden_name +
                     " or in an object beside it, or " + kPlainTopK +
                     " together with an expert count: " + join(expert_count_field_names()) + ")" +
                     note + "; is this a Mixture-of-Experts model? " + kShapeHelp);
  }

  ModelConfig cfg;
  cfg.path = path;
  const json& obj = *model->object;
  cfg.hidden_field = model->prefix + hidden_name;
  cfg.hidden = positive_int(obj[hidden_name], path, cfg.hidden_field);
  for (const std::string& name : top_k_fields_of(*top_k_object)) {
    const std::string field = top_k_prefix + name;
    const int k = top_k_value((*top_k_object)[name], path, field);
    if (cfg.top_k_field.empty()) {
      cfg.top_k = k;
      cfg.top_k_field = field;
    } else if (k != cfg.top_k) {
      throw InputError(path + ": " + cfg.top_k_field + " = " + std::to_string(cfg.top_k) + " but " +
                       field + " = " + std::to_string(k) + ": the top-k fields disagree; " +
                       kShapeHelp);
    }
  }

  // The decoder layer's norm and activation quantization, where the shape is or above it.
  std::vector<std::pair<const json*, std::string>> scopes{{model->object, model->prefix}};
  std::string prefix = model->prefix;
  for (auto it = model->ancestors.rbegin(); it != model->ancestors.rend(); ++it) {
    // Strip the last "name." from the prefix to name the enclosing object.
    const size_t cut = prefix.size() > 1 ? prefix.rfind('.', prefix.size() - 2) : std::string::npos;
    prefix = cut == std::string::npos ? std::string() : prefix.substr(0, cut + 1);
    scopes.emplace_back(*it, prefix);
  }
  for (const auto& [scope, scope_prefix] : scopes) {
    if (cfg.rms_norm_field.empty() && scope->contains("rms_norm_eps") &&
        (*scope)["rms_norm_eps"].is_number())
      cfg.rms_norm_field = scope_prefix + "rms_norm_eps";
    if (cfg.fp8_field.empty() && scope->contains("quantization_config") &&
        (*scope)["quantization_config"].is_object()) {
      const json& q = (*scope)["quantization_config"];
      if (q.contains("quant_method") && q["quant_method"].is_string() &&
          lower(q["quant_method"].get<std::string>()) == "fp8")
        cfg.fp8_field = scope_prefix + "quantization_config.quant_method";
    }
  }
  // The dtype often sits at the top level while the shape is nested: take the nearest one.
  for (const auto& [scope, scope_prefix] : scopes) {
    for (const char* name : {"torch_dtype", "dtype"}) {
      if (!scope->contains(name) || (*scope)[name].is_null()) continue;
      const json& v = (*scope)[name];
      cfg.dtype_field = scope_prefix + name;
      if (!v.is_string())
        throw InputError(path + ": field " + cfg.dtype_field + " = " + v.dump() +
                         ": expected a string such as \"bfloat16\"");
      cfg.dtype = v.get<std::string>();
      return cfg;
    }
  }
  return cfg;
}

ModelConfig read_model_config(const std::string& path) {
  return parse_model_config(read_text(path, "model config"), path);
}

const std::vector<moejit_layout>& all_layouts() {
  static const std::vector<moejit_layout> layouts{
      MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX};
  return layouts;
}

const std::vector<moejit_index_type>& all_index_types() {
  static const std::vector<moejit_index_type> types{MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64};
  return types;
}

void expand_shape(const Shape& shape, const std::vector<moejit_layout>& layouts,
                  const std::vector<moejit_index_type>& index_types,
                  std::vector<KernelSpec>* specs) {
  if (shape.hidden < 1 || shape.hidden > MOEJIT_MAX_HIDDEN_DIM)
    throw InputError(shape.origin + ": hidden size " + std::to_string(shape.hidden) +
                     " is out of range: expected 1.." + std::to_string(MOEJIT_MAX_HIDDEN_DIM));
  if (shape.top_k < 1 || shape.top_k > MOEJIT_MAX_TOP_K)
    throw InputError(shape.origin + ": top-k " + std::to_string(shape.top_k) +
                     " is out of range: expected 1.." + std::to_string(MOEJIT_MAX_TOP_K));
  // 256 bytes: what cudaMalloc and the frameworks' caching allocators hand out, so the vector
  // width matches what moe_combine() derives from real pointers.
  constexpr size_t kAlignment = 256;
  // The epilogue's buffers take the model's dtype; norm-fp8 writes fp8.
  const int res = shape.epilogue == Epilogue::kNone ? -1 : shape.dtype;
  const int weight =
      shape.epilogue == Epilogue::kNorm || shape.epilogue == Epilogue::kNormFp8 ? shape.dtype : -1;
  const moejit_dtype out =
      shape.epilogue == Epilogue::kNormFp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : shape.out_dtype;
  // Every geometry the runtime may pick for the shape (decode- and prefill-sized batches).
  for (moejit_layout layout : layouts)
    for (moejit_index_type index : index_types)
      for (const KernelSpec& s : specs_for_shape(layout, shape.dtype, out, index, shape.hidden,
                                                 shape.top_k, kAlignment, res, weight))
        add_unique(s, specs);
}

void parse_manifest(const std::string& text, const std::string& path,
                    const ManifestDefaults& defaults, std::vector<KernelSpec>* specs) {
  std::istringstream in(text);
  std::string raw;
  int number = 0;
  while (std::getline(in, raw)) {
    ++number;
    const std::string where = path + ":" + std::to_string(number);
    std::string line = raw.substr(0, raw.find('#'));
    line = trim(line);
    if (line.empty()) continue;
    std::map<std::string, std::string> kv;
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      const size_t eq = word.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == word.size())
        throw InputError(where + ": \"" + word + "\": expected key=value");
      if (!kv.emplace(word.substr(0, eq), word.substr(eq + 1)).second)
        throw InputError(where + ": key " + word.substr(0, eq) + " appears twice");
    }
    if (kv.count("kind") || kv.count("H") || kv.count("tpt") || kv.count("vec") || kv.count("in") ||
        kv.count("helpers")) {
      add_unique(exact_spec(kv, where), specs);
      continue;
    }
    static const char* shape_keys[] = {"hidden", "topk",       "dtype",   "out_dtype",
                                       "layout", "index_type", "epilogue"};
    for (const auto& entry : kv)
      if (std::find_if(std::begin(shape_keys), std::end(shape_keys),
                       [&](const char* k) { return entry.first == k; }) == std::end(shape_keys))
        throw InputError(where + ": unknown key \"" + entry.first +
                         "\"; shape lines take hidden, topk, dtype, out_dtype, layout, "
                         "index_type, epilogue (exact lines: the KernelSpec::describe() format)");
    Shape shape;
    shape.origin = where;
    if (!kv.count("hidden") || !kv.count("topk"))
      throw InputError(where + ": a shape line needs hidden=N and topk=N");
    shape.hidden = parse_int(kv["hidden"], where + ": hidden");
    shape.top_k = parse_int(kv["topk"], where + ": topk");
    if (kv.count("dtype"))
      shape.dtype = parse_dtype(kv["dtype"], where + ": dtype");
    else if (defaults.dtype)
      shape.dtype = *defaults.dtype;
    else
      throw InputError(where + ": no dtype (add dtype=bf16 to the line, or pass --dtype)");
    if (kv.count("out_dtype"))
      shape.out_dtype = parse_dtype(kv["out_dtype"], where + ": out_dtype");
    else
      shape.out_dtype = defaults.out_dtype.value_or(shape.dtype);
    std::vector<moejit_layout> layouts = defaults.layouts;
    if (kv.count("layout")) {
      layouts.clear();
      for (const std::string& l : split(kv["layout"], ','))
        layouts.push_back(parse_layout(l, where + ": layout"));
    }
    std::vector<moejit_index_type> index_types = defaults.index_types;
    if (kv.count("index_type")) {
      index_types.clear();
      for (const std::string& t : split(kv["index_type"], ','))
        index_types.push_back(parse_index_type(t, where + ": index_type"));
    }
    std::vector<Epilogue> epilogues = defaults.epilogues;
    if (kv.count("epilogue")) {
      epilogues.clear();
      for (const std::string& e : split(kv["epilogue"], ','))
        epilogues.push_back(parse_epilogue(e, where + ": epilogue"));
    }
    for (Epilogue e : epilogues) {
      shape.epilogue = e;
      expand_shape(shape, layouts, index_types, specs);
    }
  }
}

void read_manifest(const std::string& path, const ManifestDefaults& defaults,
                   std::vector<KernelSpec>* specs) {
  parse_manifest(read_text(path, "manifest"), path, defaults, specs);
}

std::string arch_list(const std::vector<int>& archs) {
  std::string s;
  for (int a : archs) s += (s.empty() ? "sm_" : ", sm_") + std::to_string(a);
  return s;
}

std::vector<Target> parse_archs(const std::string& text, const std::vector<int>& supported) {
  std::vector<Target> targets;
  auto add = [&](const Target& t) {
    if (std::find(targets.begin(), targets.end(), t) == targets.end()) targets.push_back(t);
  };
  for (const std::string& item : split(text, ',')) {
    const std::string t = lower(item);
    if (t == "all") {
      // sm_70 is the oldest GPU the combine kernels are written for.
      for (int a : supported)
        if (a >= 70) add(Target{a, false});
      continue;
    }
    bool ptx = false;
    std::string digits = t;
    if (t.rfind("sm_", 0) == 0) {
      digits = t.substr(3);
    } else if (t.rfind("compute_", 0) == 0) {
      digits = t.substr(8);
      ptx = true;
    }
    const bool numeric = !digits.empty() && digits.size() <= 4 &&
                         std::all_of(digits.begin(), digits.end(),
                                     [](unsigned char c) { return std::isdigit(c) != 0; });
    const int sm = numeric ? std::stoi(digits) : -1;
    if (!numeric || std::find(supported.begin(), supported.end(), sm) == supported.end())
      throw InputError(
          "--arch \"" + item + "\": " +
          (numeric ? "not supported by the local NVRTC" : "expected sm_XX, compute_XX or all") +
          "; it supports: " + arch_list(supported));
    add(Target{sm, ptx});
  }
  if (targets.empty())
    throw InputError("--arch \"" + text + "\": no architecture given; the local NVRTC supports: " +
                     arch_list(supported));
  return targets;
}

}  // namespace precompile
}  // namespace moejit
