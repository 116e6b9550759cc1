// A minimal streaming JSON writer: enough for the bench's result file, no dependency. Non-finite
// numbers become null (JSON has no NaN), so a failed figure can never make the file unreadable.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace moejit_bench {

class JsonWriter {
 public:
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }

  // Starts a member of the current object; the next value (or begin_*) is its value.
  JsonWriter& key(const std::string& name) {
    separate();
    out_ += quote(name) + ": ";
    after_key_ = true;
    return *this;
  }
  JsonWriter& value(const std::string& s) { return raw(quote(s)); }
  JsonWriter& value(const char* s) { return raw(s != nullptr ? quote(s) : "null"); }
  JsonWriter& value(bool b) { return raw(b ? "true" : "false"); }
  JsonWriter& value(int64_t v) { return raw(std::to_string(v)); }
  JsonWriter& value(int v) { return raw(std::to_string(v)); }
  JsonWriter& value(uint64_t v) { return raw(std::to_string(v)); }
  JsonWriter& value(double v) {
    if (!std::isfinite(v)) return raw("null");
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%.6g", v);
    return raw(buf);
  }
  JsonWriter& null() { return raw("null"); }
  template <typename T>
  JsonWriter& member(const std::string& name, const T& v) {
    key(name);
    return value(v);
  }

  const std::string& str() const { return out_; }

 private:
  JsonWriter& open(char c) {
    separate();
    out_ += c;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& close(char c) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) out_ += "\n" + std::string(2 * first_.size(), ' ');
    out_ += c;
    return *this;
  }
  JsonWriter& raw(const std::string& text) {
    separate();
    out_ += text;
    return *this;
  }
  // Commas and newlines between elements; nothing between a key and its value.
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += ",";
    first_.back() = false;
    out_ += "\n" + std::string(2 * first_.size(), ' ');
  }
  static std::string quote(const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
        q += buf;
      } else {
        q += c;
      }
    }
    return q + "\"";
  }

  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

}  // namespace moejit_bench
