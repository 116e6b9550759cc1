/* The shared library is built from moejit_core's objects; CMake needs one source of its own. */
typedef int moejit_export_anchor_unused;
