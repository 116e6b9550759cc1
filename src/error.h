// Errors inside the library: an exception carrying a public status code and a message with
// context (argument, value, allowed values; or the NVRTC log; or the failing CUresult). Only the
// C boundary (api.cpp) catches them; no exception ever leaves the library.
#pragma once

#include <stdexcept>
#include <string>

#include "moejit/moejit.h"

namespace moejit {

class Error : public std::runtime_error {
 public:
  Error(moejit_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  moejit_status status() const { return status_; }

 private:
  moejit_status status_;
};

// Throws Error(MOEJIT_ERROR_INVALID_ARGUMENT, "<argument> = <value>: <what is allowed>").
[[noreturn]] void invalid_argument(const std::string& argument, const std::string& value,
                                   const std::string& allowed);

}  // namespace moejit
