#!/usr/bin/env python3
"""tools/check-abi.sh must fail on incompatible changes and pass compatible ones: each change is
planted in a scratch copy of the tree, whose library the check builds and compares with the
baseline, and the check's verdict and report are asserted.

    abi_planted_changes.py SOURCE_DIR SCRATCH_DIR

Builds are the check's own (the library target only, -O0 -g, two jobs), in one build folder, so
a plant that touches only src/api.cpp recompiles that file alone.
"""

import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HEADER = "include/moejit/moejit.h"
API = "src/api.cpp"


def copy_tree(source, tree):
    """The checkout's files (tracked and untracked, not ignored) as they are on disk; outside a git
    checkout, every file but the build folders'."""
    shutil.rmtree(tree, ignore_errors=True)
    listed = subprocess.run(
        ["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True)
    if listed.returncode != 0:

        def unwanted(folder, names):  # build folders (this test's scratch among them), .git
            return [n for n in names if n in (".git", ".deps") or
                    (Path(folder) / n / "CMakeCache.txt").exists()]

        shutil.copytree(source, tree, ignore=unwanted, copy_function=shutil.copy)
        listed.stdout = b""
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (source / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / name, tree / name)  # a new mtime: the build sees every change
    if (source / ".deps").is_dir():  # configure.sh's xxHash fallback
        (tree / ".deps").symlink_to(source / ".deps")


def edit(text, pattern, replacement, what):
    """text with the one match of regex pattern replaced; the plant fails loudly if the tree no
    longer has what it edits."""
    new, count = re.subn(pattern, replacement, text, count=1, flags=re.DOTALL | re.MULTILINE)
    if count != 1:
        sys.exit(f"cannot plant {what}: no match for {pattern!r} (the header or api.cpp changed)")
    return new


def append_member(header, struct, member):
    return edit(header, rf"(\n\}} {struct};)", f"\n  {member}\\1", f"a member of {struct}")


def append_enumerator(header, enum, enumerator):
    return edit(header, rf"(typedef enum {enum} \{{.*?)(\s*\}} {enum};)", rf"\1,\n  {enumerator}\2",
                f"an enumerator of {enum}")


def remove_definition(api, function):
    return edit(api, rf"^moejit_status {function}\(.*?^\}}\n", "", f"the definition of {function}")


class Scratch:
    def __init__(self, source, scratch):
        self.source, self.tree, self.build = source, scratch / "tree", scratch / "build"
        copy_tree(source, self.tree)
        self.pristine = {name: (self.tree / name).read_text() for name in (HEADER, API)}
        self.failures = []

    def plant(self, **files):
        for name, text in ((HEADER, files.get("header")), (API, files.get("api"))):
            text = text if text is not None else self.pristine[name]
            if (self.tree / name).read_text() != text:
                (self.tree / name).write_text(text)

    def check(self, title):
        """Runs the check on the planted tree: (exit status, its output)."""
        print(f"\n######## {title}", flush=True)
        start = time.monotonic()
        run = subprocess.run(
            [str(self.source / "tools/check-abi.sh"), "--source", str(self.tree), "--build-dir",
             str(self.build)], capture_output=True, text=True)
        print(run.stdout + run.stderr, end="")
        seconds = time.monotonic() - start
        print(f"-------- exit {run.returncode} in {seconds:.0f} s (build included)")
        return run.returncode, run.stdout

    def expect(self, title, ran, rc, listed=(), reported=()):
        """Exit rc, each of `listed` in the report of every change, each of `reported` in the
        verdict (after the first INCOMPATIBLE heading)."""
        actual_rc, out = ran
        verdict = out.partition("\n== INCOMPATIBLE")[2]
        problems = [f"exit {actual_rc}, expected {rc}"] if actual_rc != rc else []
        problems += [f"{name!r} not in the list of changes" for name in listed if name not in out]
        problems += [f"{name!r} not in the incompatible-change report" for name in reported
                     if name not in verdict]
        for p in problems:
            print(f"FAIL ({title}): {p}")
        if problems:
            self.failures.append(title)

    def struct_bits(self, struct):
        corpus = ET.parse(self.build / "libmoejit.abi").getroot()
        for decl in corpus.iter("class-decl"):
            if decl.get("name") == struct and decl.get("is-declaration-only") != "yes":
                return int(decl.get("size-in-bits"))
        sys.exit(f"{struct} is not in the planted library's ABI")


def main():
    source, scratch = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    baseline = ET.parse(next((source / "abi").glob("libmoejit-*.abi"))).getroot()
    s = Scratch(source, scratch)
    h, api = s.pristine[HEADER], s.pristine[API]

    # Compatible: members appended to two versioned structs (8-byte ones, past any tail padding),
    # an enumerator appended, a new exported function. One build for all four.
    added = append_member(h, "moejit_combine_args", "int64_t planted_tail;")
    added = append_member(added, "moejit_runtime_options", "const char* planted_option;")
    added = append_enumerator(added, "moejit_dtype", "MOEJIT_DTYPE_PLANTED = 1000")
    added = edit(added, r"(\n#ifdef __cplusplus\n\} /\* extern \"C\" \*/)",
                 r"\nMOEJIT_API int moejit_planted_function(void);\n\1", "a declaration")
    added_api = api + '\nextern "C" int moejit_planted_function(void) { return 1; }\n'
    s.plant(header=added, api=added_api)
    title = "compatible additions: two appended members, an enumerator, a function"
    s.expect(title, s.check(title), 0, listed=("planted_tail", "planted_option",
                                               "MOEJIT_DTYPE_PLANTED", "moejit_planted_function"))

    # A removed function, on top of those additions (they passed). The header still declares it:
    # the ABI is the library's symbols and their DWARF either way, and api.cpp alone recompiles.
    s.plant(header=added, api=remove_definition(added_api, "moejit_runtime_get_stats"))
    title = "incompatible: moejit_runtime_get_stats removed"
    s.expect(title, s.check(title), 1, reported=("moejit_runtime_get_stats",))

    # A member inserted in the middle of moejit_combine_args (its initializer macro follows).
    middle = edit(h, r"(\n  moejit_layout layout;\n)", r"\1  int64_t planted_middle;\n",
                  "a member after layout")
    middle = edit(middle, r"(sizeof\(moejit_combine_args\), MOEJIT_LAYOUT_TOKEN_MAJOR, )",
                  r"\g<1>0, ", "the initializer of that member")
    s.plant(header=middle)
    title = "incompatible: a member inserted in the middle of moejit_combine_args"
    s.expect(title, s.check(title), 1, reported=("planted_middle",))

    # A 4-byte member appended to moejit_combine_args. Where the struct ends in padding within its
    # release size, the member lands there and the size stays: an old caller's struct_size would
    # cover it, so that must fail. Past the release size it is a plain append and passes.
    s.plant(header=append_member(h, "moejit_combine_args", "int32_t planted_in_padding;"))
    title = "a 4-byte member appended to moejit_combine_args"
    ran = s.check(title)
    release_bits = next(int(d.get("size-in-bits")) for d in baseline.iter("class-decl")
                        if d.get("name") == "moejit_combine_args")
    planted_bits = s.struct_bits("moejit_combine_args")
    in_padding = planted_bits <= release_bits
    print(f"moejit_combine_args: {planted_bits} bits with the member, {release_bits} in the "
          f"release: the member lies {'inside' if in_padding else 'past'} the release size")
    if in_padding:
        s.expect(title + " (into the tail padding)", ran, 1, reported=("planted_in_padding",))
    else:
        s.expect(title + " (past the release size)", ran, 0, listed=("planted_in_padding",))

    # Changed: an enum value beneath a versioned struct, a release member's type, and a function's
    # parameters, together (each must appear in the incompatible-change report). (A return type
    # changed from moejit_status to int would not do: libabigail rightly calls an enum and an int
    # of one size the same ABI, and lists the change as harmless.)
    changed = edit(h, r"MOEJIT_DTYPE_BFLOAT16 = 2\b", "MOEJIT_DTYPE_BFLOAT16 = 7", "an enum value")
    changed = edit(changed, r"\n  int accumulate;", "\n  unsigned accumulate;", "a member's type")
    changed = edit(changed, r"(moejit_runtime_destroy\(moejit_runtime_t runtime)\);",
                   r"\1, int planted_flags);", "a parameter")
    changed_api = edit(api, r"^(moejit_status moejit_runtime_destroy\(moejit_runtime_t runtime)\)",
                       r"\1, int planted_flags)", "a parameter")
    s.plant(header=changed, api=changed_api)
    title = "incompatible: an enum value, a member's type and a function's parameters changed"
    s.expect(title, s.check(title), 1,
             reported=("MOEJIT_DTYPE_BFLOAT16", "accumulate", "moejit_runtime_destroy"))

    if s.failures:
        sys.exit(f"\n{len(s.failures)} planted change(s) judged wrongly: {s.failures}")
    print("\nevery planted change judged as expected")


if __name__ == "__main__":
    main()
