#include "kernel_sources.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "error.h"

namespace moejit {
namespace {

bool is_template_name(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".cuh") || ends_with(".h");
}

}  // namespace

TemplateSet load_templates(const std::string& override_dir, const std::string& setting) {
  TemplateSet set;
  if (override_dir.empty()) {
    for (const EmbeddedFile& f : embedded_templates()) set[f.name] = std::string(f.bytes, f.size);
    return set;
  }
  DIR* dir = opendir(override_dir.c_str());
  if (dir == nullptr)
    invalid_argument(setting, "\"" + override_dir + "\"",
                     "must be a readable directory of kernel templates (or unset to use the "
                     "templates built into the library)");
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (!is_template_name(name)) continue;
    // A template that cannot be read is an error naming it (skipped, it was reported as missing,
    // or an unreadable extra header was left out of the set silently).
    const std::string path = override_dir + "/" + name;
    std::ifstream in(path, std::ios::binary);
    std::ostringstream bytes;
    if (in.is_open()) bytes << in.rdbuf();
    // Copying no bytes fails the stream for an empty file too: that one is a template all the
    // same (an empty extra header), where a directory or a read error is not.
    struct stat st {};
    const bool empty_file = stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 0;
    if (!in.is_open() || in.bad() || (!bytes && !empty_file)) {
      closedir(dir);
      invalid_argument(setting, "\"" + override_dir + "\"",
                       "must hold readable kernel templates; " + name + " could not be read");
    }
    set[name] = bytes.str();
  }
  closedir(dir);
  for (const EmbeddedFile& f : embedded_templates())
    if (set.count(f.name) == 0)
      invalid_argument(
          setting, "\"" + override_dir + "\"",
          std::string("must contain every kernel template; ") + f.name + " is missing");
  return set;
}

}  // namespace moejit
