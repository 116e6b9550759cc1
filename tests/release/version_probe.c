/* Prints the version this program was compiled with (the header's macros) and the one the library
   it runs against reports, one `name value` per line, for check_version.py. Needs no GPU. */
#include <stdio.h>

#include <moejit/moejit.h>

int main(void) {
  printf("header_major %d\n", MOEJIT_VERSION_MAJOR);
  printf("header_minor %d\n", MOEJIT_VERSION_MINOR);
  printf("header_patch %d\n", MOEJIT_VERSION_PATCH);
  printf("header_number %d\n", MOEJIT_VERSION_NUMBER);
  printf("library_number %d\n", moejit_version());
  printf("library_string %s\n", moejit_version_string());
  return 0;
}
