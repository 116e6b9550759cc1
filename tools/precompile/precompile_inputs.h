// What moejit-precompile should build, from what the operator has: a model's Hugging Face
// config.json, explicit shape lists, or a manifest file; and for which targets. Everything here is
// pure parsing and expansion (no compiling, no cache I/O), so it is unit-tested without a GPU.
//
// Expansion goes through specs_for_shape() with 256-byte alignment: exactly the modules
// moe_combine() loads for freshly allocated, unpadded buffers of that shape, so a cache warmed from
// this list serves those calls with zero compiles.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moejit/moejit.h"
#include "moejit_internal.h"

namespace moejit {
namespace precompile {

// Bad input from the operator (file, field, value, flag). The message names the file and the
// field, the value found and what was expected. The CLI maps it to its "bad input" exit code.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "fp32" | "fp16" | "bf16" and the aliases float32, float, float16, half, bfloat16 (an optional
// "torch." prefix is accepted, as configs sometimes carry it). `where` names the source for the
// message ("--dtype", "config.json: torch_dtype").
moejit_dtype parse_dtype(const std::string& text, const std::string& where);
moejit_layout parse_layout(const std::string& text, const std::string& where);
moejit_index_type parse_index_type(const std::string& text, const std::string& where);

// The epilogue a shape's calls run after the combine (moejit.h, "The epilogue"): none; the
// residual add; the residual add and the next layer's RMSNorm; that norm with an fp8 output.
// The residual and the norm weight take the shape's dtype (the model's).
enum class Epilogue { kNone, kResidual, kNorm, kNormFp8 };
// "none" | "residual" | "norm" | "norm-fp8"
const char* epilogue_name(Epilogue e);
// One of those names; throws InputError naming `where` otherwise.
Epilogue parse_epilogue(const std::string& text, const std::string& where);

// The fields of a config.json that decide the combine shape, and where each was found
// ("hidden_size", "text_config.num_experts_per_tok") for messages and the dry run.
struct ModelConfig {
  std::string path;
  int hidden = 0;
  int top_k = 0;
  std::optional<std::string> dtype;  // the raw value of torch_dtype / dtype, if any
  std::string hidden_field;
  std::string top_k_field;
  std::string dtype_field;
  // The model's decoder layers: rms_norm_eps (an RMSNorm after the residual add, which the
  // epilogue fuses), and quantization_config.quant_method "fp8" (fp8 activations, one scale per
  // token per 128 channels, as DeepSeek-V3 serves). Where each was found, "" if absent.
  std::string rms_norm_field;
  std::string fp8_field;
};

// The epilogues a model's calls run, from its config: none (the plain combine) always; with
// rms_norm_eps also "norm", and with fp8 activations "norm-fp8" too.
std::vector<Epilogue> config_epilogues(const ModelConfig& cfg);

// The MoE top-k field names, in the order they are looked for. A plain top_k (in Hugging Face
// configs usually the sampling setting) counts only in an object without any of these that also
// names a positive expert count (one of expert_count_field_names()).
const std::vector<std::string>& top_k_field_names();
const std::vector<std::string>& expert_count_field_names();

// Reads the model config at path. The top level is searched first, then nested configs
// (text_config and the like, as multimodal models nest their language model): the first object
// holding hidden_size together with a top-k field is the model; its dtype is taken from it or the
// nearest enclosing object. Throws InputError (missing file, invalid JSON, missing or non-integer
// field, MoE top-k aliases that disagree).
ModelConfig read_model_config(const std::string& path);
// The same, from text already read (`path` only names it in messages).
ModelConfig parse_model_config(const std::string& text, const std::string& path);

// One combine shape to warm. origin names where it came from, for messages.
struct Shape {
  int hidden = 0;
  int top_k = 0;  // top_k; for the token-index layout the expected rows per token
  moejit_dtype dtype = MOEJIT_DTYPE_BFLOAT16;
  moejit_dtype out_dtype = MOEJIT_DTYPE_BFLOAT16;  // norm-fp8: fp8 whatever this says
  Epilogue epilogue = Epilogue::kNone;
  std::string origin;
};

const std::vector<moejit_layout>& all_layouts();
const std::vector<moejit_index_type>& all_index_types();

// Appends to *specs, without duplicates, every specialization moe_combine() requests for shape
// under the given layouts and index types (the token-major layout has no index, so it adds one
// spec whatever the index types). Throws InputError if hidden or top_k is out of range.
void expand_shape(const Shape& shape, const std::vector<moejit_layout>& layouts,
                  const std::vector<moejit_index_type>& index_types,
                  std::vector<KernelSpec>* specs);

// Defaults a manifest's shape lines take for what they leave out (the command line's values).
struct ManifestDefaults {
  std::optional<moejit_dtype> dtype;
  std::optional<moejit_dtype> out_dtype;
  std::vector<Epilogue> epilogues{Epilogue::kNone};
  std::vector<moejit_layout> layouts = all_layouts();
  std::vector<moejit_index_type> index_types = all_index_types();
};

// Manifest: one specialization or shape per line; blank lines and '#' comments are skipped.
//  - exact spec, KernelSpec::describe() format (as printed by --dry-run and in library logs):
//      kind=gather_map in=bf16 out=bf16 idx=int32 H=7168 vec=8 K=8 tpt=128 tpb=1 upt=1
//    (the kinds are the kernel variants of src/combine_dispatch.cpp; the token index's carry
//    held= instead of K= and, where they keep lists, cap=; the list helpers are
//    "kind=token_index_list_helpers idx=int32")
//  - shape, expanded like --hidden/--topk (keys: hidden, topk, dtype, out_dtype, layout,
//    index_type, epilogue; layout, index_type and epilogue take comma lists; omitted keys take
//    the defaults):
//      hidden=7168 topk=8 dtype=bf16 layout=gather_map,token_index index_type=int32
//      hidden=7168 topk=8 dtype=bf16 epilogue=none,norm-fp8
// Appends the specs to *specs without duplicates. Throws InputError naming the file and line.
void read_manifest(const std::string& path, const ManifestDefaults& defaults,
                   std::vector<KernelSpec>* specs);
void parse_manifest(const std::string& text, const std::string& path,
                    const ManifestDefaults& defaults, std::vector<KernelSpec>* specs);

// "--arch" values: a comma list of sm_XX (or XX, or compute_XX for PTX), or "all" (every arch of
// `supported` from sm_70 up). Throws InputError for anything not in `supported`, listing it.
std::vector<Target> parse_archs(const std::string& text, const std::vector<int>& supported);

// "sm_75, sm_80, ..." for messages.
std::string arch_list(const std::vector<int>& archs);

}  // namespace precompile
}  // namespace moejit
