// The kernel templates: embedded into the library at build time (from kernel_templates/), or read
// from an override directory during development (MOEJIT_TEMPLATE_DIR / options.template_dir).
// Every file is handed to NVRTC as a named header, so no include path is searched, and all of their
// bytes take part in the cache key: editing any template invalidates what was built from it.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace moejit {

struct EmbeddedFile {
  const char* name;
  const char* bytes;
  std::size_t size;
};

// Generated at build time (cmake/embed_templates.cmake).
const std::vector<EmbeddedFile>& embedded_templates();

// File name -> contents, sorted by name (a stable order for hashing).
using TemplateSet = std::map<std::string, std::string>;

// The embedded templates, or, if override_dir is not empty, every *.cuh / *.h file in that
// directory (throws Error(MOEJIT_ERROR_INVALID_ARGUMENT) naming `setting`, the option or variable
// that gave the directory, if it cannot be read or lacks a template the library needs).
TemplateSet load_templates(const std::string& override_dir, const std::string& setting);

}  // namespace moejit
