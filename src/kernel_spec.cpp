#include "kernel_spec.h"

#include <sstream>

#include "moejit/moejit.h"

namespace moejit {

const char* dtype_name(int dtype) {
  switch (dtype) {
    case MOEJIT_DTYPE_FLOAT32:
      return "fp32";
    case MOEJIT_DTYPE_FLOAT16:
      return "fp16";
    case MOEJIT_DTYPE_BFLOAT16:
      return "bf16";
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

bool KernelSpec::token_index() const {
  return layout == MOEJIT_LAYOUT_TOKEN_INDEX;
}

KernelSpec KernelSpec::helpers_spec() const {
  KernelSpec h;
  h.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  h.index_bytes = index_bytes;
  h.helpers = true;
  return h;
}

std::vector<std::string> KernelSpec::name_expressions() const {
  const char* idx = index_bytes == 8 ? "long long" : "int";
  if (helpers)
    return {"&moejit::token_index_clear<>",
            std::string("&moejit::token_index_assign<") + idx + ">"};
  std::ostringstream combine;
  if (one_token) {
    combine << (token_index() ? "&moejit::combine_one_token<" : "&moejit::combine_one_token_map<")
            << in_dtype << ", " << out_dtype << ", " << idx << ", " << hidden << ", " << vec << ", "
            << top_k << ", " << tpt << ", " << tpb << ", " << upt << ">";
    return {combine.str()};
  }
  if (scan) {
    combine << "&moejit::combine_scan<" << in_dtype << ", " << out_dtype << ", " << idx << ", "
            << hidden << ", " << vec << ", " << top_k << ", " << tpt << ", " << tpb << ", " << upt
            << ", " << list_cap << ", " << (small_scan ? "true" : "false") << ">";
    return {combine.str()};
  }
  combine << "&moejit::combine<" << layout << ", " << in_dtype << ", " << out_dtype << ", " << idx
          << ", " << hidden << ", " << vec << ", " << top_k << ", " << tpt << ", " << tpb << ", "
          << upt << ", " << list_cap << ">";
  return {combine.str()};
}

std::string KernelSpec::source() const {
  // The kernels are instantiated through their name expressions; the source only brings the
  // template in. The spec is echoed in a comment so a dumped source says what it was for.
  return "// libmoejit specialization: " + describe() + "\n#include \"combine.cuh\"\n";
}

std::string KernelSpec::describe() const {
  std::ostringstream s;
  if (helpers) {
    s << "layout=" << layout_name(layout) << " idx=" << (index_bytes == 8 ? "int64" : "int32")
      << " helpers=1";
    return s.str();
  }
  s << "layout=" << layout_name(layout) << " in=" << dtype_name(in_dtype)
    << " out=" << dtype_name(out_dtype) << " idx=" << (index_bytes == 8 ? "int64" : "int32")
    << " H=" << hidden << " vec=" << vec << " K=" << top_k << " tpt=" << tpt << " tpb=" << tpb
    << " upt=" << upt << " cap=" << list_cap;
  if (scan) s << " scan=1";
  if (small_scan) s << " small_scan=1";
  if (one_token) s << " one_token=1";
  return s.str();
}

bool KernelSpec::operator==(const KernelSpec& o) const {
  return layout == o.layout && in_dtype == o.in_dtype && out_dtype == o.out_dtype &&
         index_bytes == o.index_bytes && hidden == o.hidden && vec == o.vec && top_k == o.top_k &&
         tpt == o.tpt && tpb == o.tpb && upt == o.upt && list_cap == o.list_cap && scan == o.scan &&
         small_scan == o.small_scan && one_token == o.one_token && helpers == o.helpers;
}

std::size_t KernelSpec::hash() const {
  std::size_t h = 1469598103934665603ull;
  for (int v : {layout, in_dtype, out_dtype, index_bytes, hidden, vec, top_k, tpt, tpb, upt,
                list_cap, static_cast<int>(scan), static_cast<int>(small_scan),
                static_cast<int>(one_token), static_cast<int>(helpers)})
    h = (h ^ static_cast<std::size_t>(static_cast<unsigned>(v))) * 1099511628211ull;
  return h;
}

}  // namespace moejit
