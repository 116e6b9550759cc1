/* Prints, as JSON, what the C compiler thinks of the public structs and constants, so the ctypes
   mirror in python/moejit/_capi.py can be compared field by field (tests/python/test_capi.py). */
#include <stddef.h>
#include <stdio.h>

#include <moejit/moejit.h>

#define FIELD(type, field)                                                         \
  printf("%s\"%s\": [%zu, %zu]", first ? "" : ", ", #field, offsetof(type, field), \
         sizeof(((type*)0)->field));                                               \
  first = 0;

int main(void) {
  int first = 1;
  printf("{\"moejit_combine_args\": {\"sizeof\": %zu, \"fields\": {", sizeof(moejit_combine_args));
  FIELD(moejit_combine_args, struct_size)
  FIELD(moejit_combine_args, layout)
  FIELD(moejit_combine_args, num_tokens)
  FIELD(moejit_combine_args, top_k)
  FIELD(moejit_combine_args, num_rows)
  FIELD(moejit_combine_args, hidden_dim)
  FIELD(moejit_combine_args, expert_hidden)
  FIELD(moejit_combine_args, expert_dtype)
  FIELD(moejit_combine_args, expert_row_stride)
  FIELD(moejit_combine_args, gates)
  FIELD(moejit_combine_args, indices)
  FIELD(moejit_combine_args, index_type)
  FIELD(moejit_combine_args, out)
  FIELD(moejit_combine_args, out_dtype)
  FIELD(moejit_combine_args, out_row_stride)
  FIELD(moejit_combine_args, scale)
  FIELD(moejit_combine_args, accumulate)
  FIELD(moejit_combine_args, workspace)
  FIELD(moejit_combine_args, workspace_bytes)
  FIELD(moejit_combine_args, dependent_launch)
  FIELD(moejit_combine_args, residual)
  FIELD(moejit_combine_args, residual_dtype)
  FIELD(moejit_combine_args, residual_row_stride)
  FIELD(moejit_combine_args, norm_weight)
  FIELD(moejit_combine_args, norm_weight_dtype)
  FIELD(moejit_combine_args, norm_eps)
  FIELD(moejit_combine_args, out_scales)
  FIELD(moejit_combine_args, out_scales_layout)
  FIELD(moejit_combine_args, out_scales_pow2)
  first = 1;
  printf("}},\n \"moejit_runtime_options\": {\"sizeof\": %zu, \"fields\": {",
         sizeof(moejit_runtime_options));
  FIELD(moejit_runtime_options, struct_size)
  FIELD(moejit_runtime_options, cache_dir)
  FIELD(moejit_runtime_options, cache_mode)
  FIELD(moejit_runtime_options, cache_max_bytes)
  FIELD(moejit_runtime_options, log_level)
  FIELD(moejit_runtime_options, template_dir)
  FIELD(moejit_runtime_options, cache_key_file)
  first = 1;
  printf("}},\n \"moejit_stats\": {\"sizeof\": %zu, \"fields\": {", sizeof(moejit_stats));
  FIELD(moejit_stats, struct_size)
  FIELD(moejit_stats, memory_hits)
  FIELD(moejit_stats, disk_hits)
  FIELD(moejit_stats, compiles)
  FIELD(moejit_stats, disk_errors)
  FIELD(moejit_stats, launches)
  FIELD(moejit_stats, compile_seconds)
  FIELD(moejit_stats, loaded_modules)
  printf(
      "}},\n \"constants\": {\"DTYPE_FLOAT32\": %d, \"DTYPE_FLOAT16\": %d, "
      "\"DTYPE_BFLOAT16\": %d, \"DTYPE_FLOAT8_E4M3\": %d, \"SCALES_ROW_MAJOR\": %d, "
      "\"SCALES_COLUMN_MAJOR_ALIGNED4\": %d, \"INDEX_INT32\": %d, \"INDEX_INT64\": %d, "
      "\"LAYOUT_TOKEN_MAJOR\": %d, \"LAYOUT_GATHER_MAP\": %d, \"LAYOUT_TOKEN_INDEX\": %d, "
      "\"MAX_HIDDEN_DIM\": %d, \"MAX_TOP_K\": %d, \"MAX_NUM_TOKENS\": %lld, "
      "\"sizeof_enum\": %zu},\n",
      MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT8_E4M3,
      MOEJIT_SCALES_ROW_MAJOR, MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4, MOEJIT_INDEX_INT32,
      MOEJIT_INDEX_INT64, MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP,
      MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_MAX_HIDDEN_DIM, MOEJIT_MAX_TOP_K,
      (long long)MOEJIT_MAX_NUM_TOKENS, sizeof(moejit_layout));
  first = 1;
  printf(" \"status\": {");
#define STATUS_ENTRY(name, value, description)                 \
  printf("%s\"%d\": \"%s\"", first ? "" : ", ", value, #name); \
  first = 0;
  MOEJIT_STATUS_TABLE(STATUS_ENTRY)
  printf("}}\n");
  return 0;
}
