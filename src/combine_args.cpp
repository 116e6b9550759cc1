#include "combine_args.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>

#include "c_enum.h"
#include "error.h"
#include "kernel_spec.h"

namespace moejit {
namespace {

// No buffer's extent in bytes (rows x row stride x element size) may exceed this: device
// addresses have at most 57 bits, and the kernels form row offsets in 64-bit arithmetic that
// must not wrap.
constexpr int64_t kMaxExtentBytes = int64_t{1} << 62;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

void check_enum(const char* name, int value, int max, const char* allowed) {
  if (value < 0 || value > max) invalid_argument(name, std::to_string(value), allowed);
}

void check_aligned(const char* name, const void* p, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
    invalid_argument(name, hex(p),
                     std::string("must be aligned to its element size (") + std::to_string(bytes) +
                         " bytes for " + what + ")");
}

// rows rows of `stride` elements must span at most kMaxExtentBytes: a larger stride names memory
// no device has, and the kernels' 64-bit row offsets would wrap.
void check_extent(const char* name, int64_t stride, int64_t rows, const char* rows_name,
                  int dtype) {
  // Multiplications with an overflow check, not divisions: this runs on every call.
  int64_t bytes = 0;
  if (__builtin_mul_overflow(stride, rows, &bytes) ||
      __builtin_mul_overflow(bytes, int64_t{element_bytes(dtype)}, &bytes) ||
      bytes > kMaxExtentBytes)
    invalid_argument(name, std::to_string(stride),
                     std::string("is too large: ") + rows_name + " = " + std::to_string(rows) +
                         " rows of that many " + dtype_name(dtype) +
                         " elements span more than 2^62 bytes, more memory than any device has");
}

// One device buffer an argument names: [begin, end) in bytes (empty where the call reads none).
struct ByteRange {
  const char* name;
  uint64_t begin = 0, end = 0;
};

ByteRange byte_range(const char* name, const void* p, uint64_t bytes) {
  const uint64_t begin = reinterpret_cast<uintptr_t>(p);
  uint64_t end = 0;
  if (p == nullptr || bytes == 0) return {name, 0, 0};
  // A range past the end of the address space would wrap to low addresses, where the overlap
  // checks do not look; no device buffer does that.
  if (__builtin_add_overflow(begin, bytes, &end))
    invalid_argument(name, hex(p),
                     "spans " + std::to_string(bytes) +
                         " bytes, past the end of the 64-bit address space");
  return {name, begin, end};
}

// The kernels read the routing, gates and rows (and the workspace lists) while they write out, in
// no order between blocks: buffers that share bytes give a race, not an error. The written buffer
// w is compared with each one read (a few comparisons per call); a padded row stride counts its
// padding.
void check_no_overlap(const ByteRange& w, std::initializer_list<ByteRange> read) {
  for (const ByteRange& o : read)
    if (w.begin < w.end && o.begin < o.end && w.begin < o.end && o.begin < w.end)
      invalid_argument(w.name,
                       "[" + hex(reinterpret_cast<const void*>(w.begin)) + ", " +
                           hex(reinterpret_cast<const void*>(w.end)) + ")",
                       std::string("overlaps ") + o.name + " [" +
                           hex(reinterpret_cast<const void*>(o.begin)) + ", " +
                           hex(reinterpret_cast<const void*>(o.end)) +
                           "): the kernels read it while they write; pass separate buffers");
}

// ---- the epilogue's fields (since 0.3) ----

constexpr const char* kValueDtypes =
    "must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or MOEJIT_DTYPE_BFLOAT16 (2)";

// The shape fields of the epilogue: the dtypes and stride of what is set, the scales' layout of an
// fp8 out. What is not set is not checked, and its fields are reset to their defaults (the plan
// reads them as enums, and a load of an out-of-range enum value is undefined).
void check_epilogue_shape(moejit_combine_args& a) {
  const moejit_combine_args defaults = MOEJIT_COMBINE_ARGS_INIT;
  if (a.residual != nullptr) {
    check_enum("args->residual_dtype", c_enum_value(a.residual_dtype), 2, kValueDtypes);
    if (a.residual_row_stride == 0) a.residual_row_stride = a.hidden_dim;
    if (a.residual_row_stride < a.hidden_dim)
      invalid_argument(
          "args->residual_row_stride", std::to_string(a.residual_row_stride),
          "must be 0 (= hidden_dim) or >= hidden_dim = " + std::to_string(a.hidden_dim));
    check_extent("args->residual_row_stride", a.residual_row_stride, a.num_tokens, "num_tokens",
                 a.residual_dtype);
  } else {
    a.residual_dtype = defaults.residual_dtype;
    a.residual_row_stride = 0;
  }
  if (a.norm_weight != nullptr)
    check_enum("args->norm_weight_dtype", c_enum_value(a.norm_weight_dtype), 2, kValueDtypes);
  else
    a.norm_weight_dtype = defaults.norm_weight_dtype;
  if (a.out_dtype == MOEJIT_DTYPE_FLOAT8_E4M3) {
    check_enum("args->out_scales_layout", c_enum_value(a.out_scales_layout), 1,
               "must be MOEJIT_SCALES_ROW_MAJOR (0) or MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 (1)");
    if (a.out_scales_layout == MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 && a.hidden_dim % 128 != 0)
      invalid_argument("args->out_scales_layout",
                       "MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 (1) with hidden_dim = " +
                           std::to_string(a.hidden_dim),
                       "needs hidden_dim % 128 == 0 (whole groups of 128 channels); use "
                       "MOEJIT_SCALES_ROW_MAJOR (0) for this hidden size");
  } else {
    a.out_scales_layout = defaults.out_scales_layout;
  }
}

}  // namespace

bool known_combine_args_size(size_t size) {
  return size == sizeof(moejit_combine_args) || size == kCombineArgsSizeV02 ||
         size == kCombineArgsSizeV01;
}

int64_t scale_groups(int64_t hidden_dim) {
  return (hidden_dim + 127) / 128;
}

uint64_t out_scales_span(const moejit_combine_args& a) {
  if (a.num_tokens == 0) return 0;
  const uint64_t t = static_cast<uint64_t>(a.num_tokens),
                 g = static_cast<uint64_t>(scale_groups(a.hidden_dim));
  // Column-major: the last group's column ends at token T - 1.
  return a.out_scales_layout == MOEJIT_SCALES_ROW_MAJOR ? t * g : (g - 1) * ((t + 3) / 4 * 4) + t;
}

moejit_combine_args validated_shape(const moejit_combine_args* in) {
  if (in == nullptr) invalid_argument("args", "NULL", "must point to a moejit_combine_args");
  // The defaults as a constant, not through the exported init function: this runs on every call.
  moejit_combine_args a = MOEJIT_COMBINE_ARGS_INIT;
  // An older header's struct ends earlier: the fields it lacks keep their defaults.
  if (!known_combine_args_size(in->struct_size))
    invalid_argument(
        "args->struct_size", std::to_string(in->struct_size),
        "must be sizeof(moejit_combine_args) = " + std::to_string(sizeof(moejit_combine_args)) +
            " for this library version (" + moejit_version_string() + "), or " +
            std::to_string(kCombineArgsSizeV02) + " from a 0.2 header, or " +
            std::to_string(kCombineArgsSizeV01) +
            " from a 0.1 header; initialize args with moejit_combine_args_init()");
  std::memcpy(&a, in, in->struct_size);
  a.struct_size = sizeof(a);

  check_enum("args->layout", c_enum_value(a.layout), 2,
             "must be MOEJIT_LAYOUT_TOKEN_MAJOR (0), MOEJIT_LAYOUT_GATHER_MAP (1) or "
             "MOEJIT_LAYOUT_TOKEN_INDEX (2)");
  check_enum("args->expert_dtype", c_enum_value(a.expert_dtype), 2,
             "must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or MOEJIT_DTYPE_BFLOAT16 "
             "(2) (MOEJIT_DTYPE_FLOAT8_E4M3 is an out_dtype only)");
  check_enum("args->out_dtype", c_enum_value(a.out_dtype), 3,
             "must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1), "
             "MOEJIT_DTYPE_BFLOAT16 (2) or MOEJIT_DTYPE_FLOAT8_E4M3 (3, with out_scales)");
  if (a.layout != MOEJIT_LAYOUT_TOKEN_MAJOR)
    check_enum("args->index_type", c_enum_value(a.index_type), 1,
               "must be MOEJIT_INDEX_INT32 (0) or MOEJIT_INDEX_INT64 (1)");
  else
    // Token-major reads no indices, so any int the caller left there is accepted; overwritten,
    // since the plan still reads the field as the enum (a load of an out-of-range value is UB).
    a.index_type = MOEJIT_INDEX_INT32;
  if (a.num_tokens < 0 || a.num_tokens > kMaxTokens)
    invalid_argument("args->num_tokens", std::to_string(a.num_tokens),
                     "must be in 0.." + std::to_string(kMaxTokens) + " (2^40)");
  if (a.hidden_dim < 1 || a.hidden_dim > MOEJIT_MAX_HIDDEN_DIM)
    invalid_argument("args->hidden_dim", std::to_string(a.hidden_dim),
                     "must be in 1.." + std::to_string(MOEJIT_MAX_HIDDEN_DIM));
  if (a.layout != MOEJIT_LAYOUT_TOKEN_INDEX && (a.top_k < 1 || a.top_k > MOEJIT_MAX_TOP_K))
    invalid_argument("args->top_k", std::to_string(a.top_k),
                     std::string("must be in 1..") + std::to_string(MOEJIT_MAX_TOP_K) +
                         " for the " + layout_name(a.layout) + " layout");
  if (a.layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
    if (a.num_tokens > INT64_MAX / a.top_k)
      invalid_argument("args->num_tokens", std::to_string(a.num_tokens), "is too large");
    const int64_t rows = a.num_tokens * a.top_k;
    if (a.num_rows != 0 && a.num_rows != rows)
      invalid_argument("args->num_rows", std::to_string(a.num_rows),
                       "must be 0 or num_tokens * top_k = " + std::to_string(rows) +
                           " for the token-major layout");
    a.num_rows = rows;
  } else {
    if (a.num_rows < 0 || a.num_rows > kMaxRows)
      invalid_argument("args->num_rows", std::to_string(a.num_rows),
                       "must be in 0.." + std::to_string(kMaxRows));
  }
  if (a.dependent_launch != 0 && a.dependent_launch != 1)
    invalid_argument("args->dependent_launch", std::to_string(a.dependent_launch),
                     "must be 0 (plain launch) or 1 (programmatic dependent launch)");
  if (a.expert_row_stride == 0) a.expert_row_stride = a.hidden_dim;
  if (a.out_row_stride == 0) a.out_row_stride = a.hidden_dim;
  if (a.expert_row_stride < a.hidden_dim)
    invalid_argument("args->expert_row_stride", std::to_string(a.expert_row_stride),
                     "must be 0 (= hidden_dim) or >= hidden_dim = " + std::to_string(a.hidden_dim));
  if (a.out_row_stride < a.hidden_dim)
    invalid_argument("args->out_row_stride", std::to_string(a.out_row_stride),
                     "must be 0 (= hidden_dim) or >= hidden_dim = " + std::to_string(a.hidden_dim));
  check_extent("args->expert_row_stride", a.expert_row_stride, a.num_rows, "num_rows",
               a.expert_dtype);
  check_extent("args->out_row_stride", a.out_row_stride, a.num_tokens, "num_tokens", a.out_dtype);
  check_epilogue_shape(a);
  return a;
}

void check_buffers(const moejit_combine_args& a, size_t workspace_bytes) {
  const int in_b = element_bytes(a.expert_dtype), out_b = element_bytes(a.out_dtype);
  const bool any_rows = a.num_rows > 0 && a.num_tokens > 0;
  if (a.num_tokens > 0 && a.out == nullptr)
    invalid_argument("args->out", "NULL", "must be a device pointer when num_tokens > 0");
  if (any_rows && a.expert_hidden == nullptr)
    invalid_argument("args->expert_hidden", "NULL", "must be a device pointer when num_rows > 0");
  // The gather map has T * K entries whatever R is (with R = 0 every one is dropped, but the
  // kernels still read them); token_idx has R.
  if (a.layout == MOEJIT_LAYOUT_GATHER_MAP && a.num_tokens > 0 && a.indices == nullptr)
    invalid_argument("args->indices", "NULL",
                     "must be a device pointer (the gather map, num_tokens * top_k entries) for "
                     "the gather_map layout when num_tokens > 0, even with num_rows = 0");
  if (a.layout == MOEJIT_LAYOUT_TOKEN_INDEX && any_rows && a.indices == nullptr)
    invalid_argument("args->indices", "NULL",
                     "must be a device pointer (the token_idx) for the token_index layout when "
                     "num_rows > 0");
  check_aligned("args->expert_hidden", a.expert_hidden, in_b, dtype_name(a.expert_dtype));
  check_aligned("args->out", a.out, out_b, dtype_name(a.out_dtype));
  check_aligned("args->gates", a.gates, 4, "fp32 gates");
  if (a.layout != MOEJIT_LAYOUT_TOKEN_MAJOR)
    check_aligned("args->indices", a.indices, a.index_type == MOEJIT_INDEX_INT64 ? 8 : 4,
                  a.index_type == MOEJIT_INDEX_INT64 ? "int64 indices" : "int32 indices");
  if (a.accumulate != 0 && a.accumulate != 1)
    invalid_argument("args->accumulate", std::to_string(a.accumulate),
                     "must be 0 (overwrite out) or 1 (add into out)");
  if (!std::isfinite(a.scale))
    invalid_argument("args->scale", std::to_string(a.scale), "must be a finite number");
  // The epilogue's buffers (since 0.3).
  const bool fp8 = a.out_dtype == MOEJIT_DTYPE_FLOAT8_E4M3;
  if (a.residual != nullptr)
    check_aligned("args->residual", a.residual,
                  static_cast<size_t>(element_bytes(a.residual_dtype)),
                  dtype_name(a.residual_dtype));
  if (a.norm_weight != nullptr) {
    check_aligned("args->norm_weight", a.norm_weight,
                  static_cast<size_t>(element_bytes(a.norm_weight_dtype)),
                  dtype_name(a.norm_weight_dtype));
    if (!std::isfinite(a.norm_eps) || a.norm_eps < 0.0f)
      invalid_argument("args->norm_eps", std::to_string(a.norm_eps),
                       "must be a finite number >= 0 (the RMSNorm's epsilon, e.g. 1e-6)");
  }
  if (a.out_scales != nullptr && !fp8)
    invalid_argument("args->out_scales", hex(a.out_scales),
                     std::string("must be NULL: out_dtype is ") + dtype_name(a.out_dtype) +
                         "; only an fp8 out (MOEJIT_DTYPE_FLOAT8_E4M3) has scales");
  if (fp8 && a.num_tokens > 0 && a.out_scales == nullptr)
    invalid_argument("args->out_scales", "NULL",
                     "must be a device pointer (fp32, one scale per token per 128 channels) for "
                     "an fp8 out (out_dtype MOEJIT_DTYPE_FLOAT8_E4M3)");
  check_aligned("args->out_scales", a.out_scales, 4, "fp32 scales");
  if (fp8 && a.out_scales_pow2 != 0 && a.out_scales_pow2 != 1)
    invalid_argument("args->out_scales_pow2", std::to_string(a.out_scales_pow2),
                     "must be 0 (scale = amax / 448) or 1 (rounded up to a power of two)");

  if (a.num_tokens == 0) return;

  // The bytes each buffer spans (strides included), for the overlap checks here and with the
  // workspace below.
  const uint64_t idx_b = a.index_type == MOEJIT_INDEX_INT64 ? 8 : 4;
  const uint64_t routed = a.layout == MOEJIT_LAYOUT_TOKEN_INDEX
                              ? static_cast<uint64_t>(a.num_rows)
                              : static_cast<uint64_t>(a.num_tokens * a.top_k);
  const ByteRange out_bytes = byte_range(
      "args->out", a.out,
      (static_cast<uint64_t>(a.num_tokens - 1) * static_cast<uint64_t>(a.out_row_stride) +
       static_cast<uint64_t>(a.hidden_dim)) *
          static_cast<uint64_t>(out_b));
  const ByteRange expert_bytes =
      byte_range("args->expert_hidden", any_rows ? a.expert_hidden : nullptr,
                 (static_cast<uint64_t>(a.num_rows > 0 ? a.num_rows - 1 : 0) *
                      static_cast<uint64_t>(a.expert_row_stride) +
                  static_cast<uint64_t>(a.hidden_dim)) *
                     static_cast<uint64_t>(in_b));
  const ByteRange index_bytes = byte_range(
      "args->indices", a.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : a.indices, routed * idx_b);
  const ByteRange gate_bytes = byte_range("args->gates", a.gates, routed * 4);
  const ByteRange residual_bytes = byte_range(
      "args->residual", a.residual,
      (static_cast<uint64_t>(a.num_tokens - 1) * static_cast<uint64_t>(a.residual_row_stride) +
       static_cast<uint64_t>(a.hidden_dim)) *
          static_cast<uint64_t>(element_bytes(a.residual_dtype)));
  const ByteRange weight_bytes =
      byte_range("args->norm_weight", a.norm_weight,
                 static_cast<uint64_t>(a.hidden_dim) *
                     static_cast<uint64_t>(element_bytes(a.norm_weight_dtype)));
  const ByteRange scale_bytes =
      byte_range("args->out_scales", a.out_scales, fp8 ? out_scales_span(a) * 4 : 0);
  // Every written buffer against every other (norm_weight, read only, may share the inputs').
  check_no_overlap(out_bytes, {expert_bytes, index_bytes, gate_bytes, residual_bytes, weight_bytes,
                               scale_bytes});
  check_no_overlap(residual_bytes,
                   {expert_bytes, index_bytes, gate_bytes, weight_bytes, scale_bytes});
  check_no_overlap(scale_bytes, {expert_bytes, index_bytes, gate_bytes, weight_bytes});

  if (a.layout != MOEJIT_LAYOUT_TOKEN_INDEX) return;
  const size_t needed = workspace_bytes;
  if (a.workspace == nullptr || a.workspace_bytes < needed)
    throw Error(MOEJIT_ERROR_WORKSPACE_TOO_SMALL,
                "args->workspace = " + hex(a.workspace) +
                    " with workspace_bytes = " + std::to_string(a.workspace_bytes) +
                    ": the token-index layout needs " + std::to_string(needed) +
                    " bytes of device memory here (moejit_combine_workspace_size())");
  if (reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0)
    invalid_argument("args->workspace", hex(a.workspace),
                     "must be aligned to 16 bytes, as moejit.h asks of the workspace");
  const ByteRange ws_bytes = byte_range("args->workspace", a.workspace, needed);
  check_no_overlap(ws_bytes, {out_bytes, expert_bytes, index_bytes, gate_bytes, residual_bytes,
                              weight_bytes, scale_bytes});
}

int element_bytes(int dtype) {
  return dtype == MOEJIT_DTYPE_FLOAT32 ? 4 : dtype == MOEJIT_DTYPE_FLOAT8_E4M3 ? 1 : 2;
}

}  // namespace moejit
