#!/usr/bin/env python3
"""docs/distributed.md's "Options in every pipe" table says what
tests/distributed/option_matrix_test.cpp's kTable runs: the same options, in the same order, and
per kind of pipe the same outcome (yes, refused or -, the first word of each cell)."""
import re
import sys

test_path, doc_path = sys.argv[1], sys.argv[2]
src = open(test_path).read()
table = src[src.index("option-table-begin"):src.index("option-table-end")]
rows = re.findall(r'\{"([^"]+)",\s*\{([^}]*)\}\}', table)
code = [(name, [c.strip() for c in cells.split(",")]) for name, cells in rows]
names = {"yes": "yes", "refused": "refused", "none": "-"}
code = [(name, [names[c] for c in cells]) for name, cells in code]

doc = open(doc_path).read()
section = doc[doc.index("## Options in every pipe"):]
section = section[:section.index("\n## ", 3)]
lines = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| ---")]
docs = []
for line in lines[1:]:  # the header is the first
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    docs.append((cells[0], [re.match(r"(yes|refused|-)", c).group(1) if re.match(r"(yes|refused|-)", c) else c for c in cells[1:6]]))

problems = []
if [n for n, _ in code] != [n for n, _ in docs]:
    problems.append("options differ:\n  test: %s\n  docs: %s" % ([n for n, _ in code], [n for n, _ in docs]))
for (name, want), (_, got) in zip(code, docs):
    if want != got:
        problems.append("%s: the test runs %s, the docs say %s" % (name, want, got))
if problems:
    print("\n".join(problems))
    sys.exit(1)
print("%d options x 5 kinds of pipe: docs and test agree" % len(code))
