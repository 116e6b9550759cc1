#include "error.h"

namespace moejit {

void invalid_argument(const std::string& argument, const std::string& value,
                      const std::string& allowed) {
  throw Error(MOEJIT_ERROR_INVALID_ARGUMENT,
              "invalid argument " + argument + " = " + value + ": " + allowed);
}

}  // namespace moejit
