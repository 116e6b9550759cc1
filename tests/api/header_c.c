/* Compiled as strict C99: the public header must be valid C. Also exercises the C API from C. */
#include <moejit/moejit.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  moejit_combine_args args = MOEJIT_COMBINE_ARGS_INIT;
  moejit_combine_args from_init;
  moejit_runtime_options options;
  moejit_stats stats;
  moejit_runtime_t runtime = NULL;
  size_t bytes = 1;
  if (moejit_combine_args_init(&from_init) != MOEJIT_SUCCESS) return 1;
  if (memcmp(&args, &from_init, sizeof(args)) != 0) {
    fprintf(stderr, "MOEJIT_COMBINE_ARGS_INIT differs from moejit_combine_args_init()\n");
    return 1;
  }
  if (moejit_runtime_options_init(&options) != MOEJIT_SUCCESS) return 1;
  args.num_tokens = 4;
  args.top_k = 2;
  args.hidden_dim = 128;
  if (moejit_combine_workspace_size(&args, &bytes) != MOEJIT_SUCCESS || bytes != 0) return 1;
  args.hidden_dim = 0;
  if (moe_combine(&args, NULL) != MOEJIT_ERROR_INVALID_ARGUMENT) return 1;
  if (strstr(moejit_last_error_message(), "hidden_dim") == NULL) return 1;
  /* C may pass any int as an enum: the library reads it as such and names it. */
  if (strcmp(moejit_status_name((moejit_status)999), "MOEJIT_STATUS_UNKNOWN") != 0) return 1;
  if (strcmp(moejit_status_description((moejit_status)-1), "unknown status code") != 0) return 1;
  args.hidden_dim = 128;
  args.layout = (moejit_layout)7;
  if (moe_combine(&args, NULL) != MOEJIT_ERROR_INVALID_ARGUMENT) return 1;
  if (strstr(moejit_last_error_message(), "args->layout = 7") == NULL) return 1;
  args.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  args.out_dtype = (moejit_dtype)-1;
  if (moe_combine(&args, NULL) != MOEJIT_ERROR_INVALID_ARGUMENT) return 1;
  if (strstr(moejit_last_error_message(), "args->out_dtype = -1") == NULL) return 1;
  options.log_level = (moejit_log_level)100;
  if (moejit_runtime_create(&options, &runtime) != MOEJIT_ERROR_INVALID_ARGUMENT) return 1;
  if (runtime != NULL || strstr(moejit_last_error_message(), "log_level = 100") == NULL) return 1;
  stats.struct_size = sizeof(stats);
  if (moejit_runtime_get_stats(NULL, &stats) != MOEJIT_SUCCESS) return 1;
  printf("libmoejit %s (%d) from C99: %s\n", moejit_version_string(), moejit_version(),
         moejit_status_name(MOEJIT_ERROR_INVALID_ARGUMENT));
  return moejit_version() == MOEJIT_VERSION_NUMBER ? 0 : 1;
}
