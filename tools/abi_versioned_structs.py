#!/usr/bin/env python3
"""What tools/check-abi.sh allows the struct_size-versioned structs, from a baseline's abidw XML.

A struct of the public header whose first member is `struct_size` may grow at its end: old
callers pass their shorter size and the library reads only what it covers. That is compatible
only if every new member lies past the baseline's whole size (inside the tail padding, the old
size would cover it and the library could not tell an old caller from a new one) and nothing
before it changed. The two subcommands give libabigail each half of that rule:

  suppressions BASELINE
      a suppression specification (stdout): for each versioned struct, changes seen through a
      pointer where every inserted member starts at or past the baseline's size in bits; added
      functions and variables. Such a type suppression hides the whole struct's change, members
      changed before the end included, hence:
  prefix BASELINE CURRENT
      CURRENT's abidw XML (stdout) with each versioned struct cut back to the baseline's member
      count and size, so that abidiff of BASELINE against it, with no type suppressed, reports
      any change to a member the baseline had (its type, offset, name, or an enum beneath it).
  additions
      the suppression specification of added functions and variables alone, for that abidiff.
"""

import sys
import xml.etree.ElementTree as ET

ADDITIONS = """\
[suppress_function]
  label = a function added
  change_kind = added-function
[suppress_variable]
  label = a variable added
  change_kind = added-variable
"""


def data_members(class_decl):
    return [m for m in class_decl if m.tag == "data-member"]


def versioned_structs(corpus):
    """{name: (size in bits, member count)} of the defined structs whose first member is
    struct_size."""
    found = {}
    for decl in corpus.iter("class-decl"):
        if decl.get("is-struct") != "yes" or decl.get("is-declaration-only") == "yes":
            continue
        members = data_members(decl)
        first = members[0].find("var-decl") if members else None
        if first is None or first.get("name") != "struct_size":
            continue
        found[decl.get("name")] = (int(decl.get("size-in-bits")), len(members))
    if not found:
        sys.exit(f"{sys.argv[2]}: no struct whose first member is struct_size: not an abidw "
                 "dump of libmoejit made with its public headers")
    return found


def suppressions(baseline):
    out = []
    for name, (bits, _) in sorted(versioned_structs(baseline).items()):
        out.append(f"""\
[suppress_type]
  label = {name} grows past its baseline size ({bits} bits), seen through a pointer
  type_kind = struct
  name = {name}
  has_data_member_inserted_between = {{{bits}, end}}
  accessed_through = pointer
""")
    return "".join(out) + ADDITIONS


def prefix(baseline, current_tree):
    structs = versioned_structs(baseline)
    for decl in current_tree.getroot().iter("class-decl"):
        if decl.get("name") not in structs or decl.get("is-declaration-only") == "yes":
            continue
        bits, count = structs[decl.get("name")]
        for extra in data_members(decl)[count:]:
            decl.remove(extra)
        decl.set("size-in-bits", str(bits))
    return current_tree


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "additions":
        sys.stdout.write(ADDITIONS)
    elif len(sys.argv) == 3 and sys.argv[1] == "suppressions":
        sys.stdout.write(suppressions(ET.parse(sys.argv[2]).getroot()))
    elif len(sys.argv) == 4 and sys.argv[1] == "prefix":
        tree = prefix(ET.parse(sys.argv[2]).getroot(), ET.parse(sys.argv[3]))
        tree.write(sys.stdout.buffer, encoding="utf-8", xml_declaration=False)
        sys.stdout.write("\n")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
