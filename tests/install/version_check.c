/* Compiled by install.pkgconfig with nothing but `pkg-config --cflags --libs moejit`: proves the
   installed header and library are usable together and that the C API is exported. Needs no GPU:
   it only calls functions that never touch the driver. */
#include <stdio.h>
#include <string.h>

#include <moejit/moejit.h>

int main(void) {
  if (moejit_version() != MOEJIT_VERSION_NUMBER) {
    printf("FAIL: header version %d, library version %d\n", MOEJIT_VERSION_NUMBER,
           moejit_version());
    return 1;
  }
  moejit_combine_args args = MOEJIT_COMBINE_ARGS_INIT;
  size_t bytes = 0;
  /* hidden_dim 0 is a caller error, reported with a status name and a message naming it. */
  const moejit_status st = moejit_combine_workspace_size(&args, &bytes);
  if (st != MOEJIT_ERROR_INVALID_ARGUMENT ||
      strcmp(moejit_status_name(st), "MOEJIT_ERROR_INVALID_ARGUMENT") != 0 ||
      strstr(moejit_last_error_message(), "hidden_dim") == NULL) {
    printf("FAIL: moejit_combine_workspace_size returned %s: %s\n", moejit_status_name(st),
           moejit_last_error_message());
    return 1;
  }
  printf("PASS: libmoejit %s\n", moejit_version_string());
  return 0;
}
