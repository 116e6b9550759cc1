// Reading an enum value that came from C. A C caller may store any int in an enum-typed field or
// pass any int as an enum argument (C enums are ints), but in C++ an enum without a fixed
// underlying type only holds the values of its enumerators' bit range: loading 999 from a
// moejit_status, or 7 from a moejit_layout, is undefined behaviour (UBSan: "load of value 7, which
// is not a valid value for type 'moejit_layout'"), and a compiler may drop a range check it
// considers always true. So a caller's enum is read through its object representation, as the
// int the caller stored, and checked as such before it is used as the enum.
#pragma once

#include <cstring>

namespace moejit {

template <typename E>
int c_enum_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "the C API's enums are int-sized");
  int value;
  std::memcpy(&value, &e, sizeof(value));
  return value;
}

}  // namespace moejit
