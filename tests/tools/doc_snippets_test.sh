#!/usr/bin/env bash
# tools/doc_snippets on made-up docs: where each snippet's lines go (declarations at namespace
# scope, statements in a function, each after a #line naming the doc), which unit each goes to
# (by its umbrella includes, or its file's), before or after <torch/torch.h> (by whether it
# includes it), fragments skipped, and the problems it refuses.
#   usage: doc_snippets_test.sh DOC_SNIPPETS
set -uo pipefail
tool=$1

fail() {
  echo "doc_snippets_test: FAILED: $*" >&2
  exit 1
}

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/a.md" <<'DOC'
# A
```cpp
#include <stagewise/stagewise.hpp>
namespace sw = stagewise;

struct Mine {
  int f() const { return 1; }
};
auto pipe = sw::Pipe(model, sw::balance{1, 1});
pipe->train_step(x, y,
                 loss_fn);
```
Text, then a block in the same file: it takes the file's umbrella.
```cpp
for (auto& [x, y] : data) {
  x.add_(1);
}
```
```cpp fragment
template <class L> struct Half { ... };
```
```sh
echo not C++
```
DOC
cat >"$dir/b.md" <<'DOC'
```cpp
#include <stagewise/distributed.hpp>
auto d = 1;
```
- In a list:
  ```cpp
  #include <stagewise/stagewise.hpp>
  #include <stagewise/distributed.hpp>
  auto both = 2;
  ```
DOC
cat >"$dir/c.md" <<'DOC'
```cpp
#include <stagewise/stagewise.hpp>
#include <torch/torch.h>
torch::nn::Linear with_torch(1, 1);
```
```cpp
auto continued = 3;
```
```cpp
#include <stagewise/stagewise.hpp>
auto umbrella_only = 4;
```
DOC
out=$("$tool" "$dir/out" "$dir/a.md" "$dir/b.md" "$dir/c.md") || fail "good docs: exit $?: $out"
grep -qx "doc_snippets: 7 snippets (1 fragments) from 3 files" <<<"$out" || fail "summary: $out"
one=$dir/out/one_process.cpp
dist=$dir/out/distributed.cpp
[[ $(head -2 "$one" | tail -1) == "#include <stagewise/stagewise.hpp>" ]] || fail "one_process.cpp's include"
[[ $(head -2 "$dist" | tail -1) == "#include <stagewise/distributed.hpp>" ]] || fail "distributed.cpp's include"
# The first block: its declarations before the function, its statements inside it.
body=$(sed -n "/^namespace doc_.*a_md_2 {/,/^}  \/\/ namespace doc_.*a_md_2/p" "$one")
[[ -n $body ]] || fail "no namespace for a.md:2 in $(cat "$one")"
before=$(sed '/void snippet()/q' <<<"$body")
after=$(sed -n '/void snippet()/,$p' <<<"$body")
grep -q "^struct Mine {" <<<"$before" || fail "the struct is not at namespace scope: $body"
grep -q "^namespace sw = stagewise;" <<<"$before" || fail "the alias is not at namespace scope"
grep -q "^auto pipe = sw::Pipe" <<<"$after" || fail "the statement is not in the function: $body"
grep -q "^                 loss_fn);" <<<"$after" || fail "a continued statement was split: $body"
grep -q "auto pipe" <<<"$before" && fail "a statement went to namespace scope: $body"
grep -q "#include" <<<"$body" && fail "the snippet's include was kept: $body"
[[ $(grep -c '^#line 3 ".*a.md"$' <<<"$body") == 2 ]] || fail "#line 3 twice (declarations, statements): $body"
# The block without includes follows its file's umbrella; the fragment and the sh block are out.
grep -q "^  x.add_(1);" "$one" || fail "a.md's second block is not in one_process.cpp"
grep -q "Half" "$one" "$dist" && fail "the fragment was compiled"
grep -q "not C++" "$one" "$dist" && fail "a sh block was taken"
# distributed.hpp alone, then stagewise.hpp and the block that includes both.
grep -q "auto d = 1;" "$one" && fail "b.md's distributed block went to one_process.cpp"
awk '/auto d = 1;/ {d = NR} /^#include <stagewise\/stagewise.hpp>/ {s = NR} /auto both = 2;/ {b = NR}
     END {exit !(d && s && b && d < s && s < b)}' "$dist" || fail "distributed.cpp's order: $(cat "$dist")"

# The prelude includes nothing; a block that includes <torch/torch.h> (or follows one in its file)
# comes after it, the others before it, so they see the umbrella alone.
grep -q "^#include <torch/nn" "$one" && fail "the prelude includes a LibTorch header: $(cat "$one")"
awk '/auto umbrella_only = 4;/ {u = NR} /^  x.add_\(1\);/ {a = NR} /^#include <torch\/torch.h>/ {t = NR}
     /with_torch\(1, 1\);/ {w = NR} /auto continued = 3;/ {c = NR}
     END {exit !(u && a && t && w && c && u < t && a < t && t < w && t < c)}' "$one" ||
  fail "one_process.cpp's order around <torch/torch.h>: $(cat "$one")"

# Problems: an include that is not an umbrella, and another word after cpp.
printf '```cpp\n#include <stagewise/pipe/pipe_over.hpp>\nint a = 0;\n```\n```cpp ignore\nint b;\n```\n' \
  >"$dir/bad.md"
err=$("$tool" "$dir/out2" "$dir/bad.md" 2>&1 >/dev/null)
rc=$?
[[ $rc -eq 1 ]] || fail "expected exit 1 on bad docs, got $rc"
grep -qF "bad.md:1: includes <stagewise/pipe/pipe_over.hpp>; a snippet compiles after the umbrella alone (<stagewise/stagewise.hpp> or <stagewise/distributed.hpp>) and, if it includes it, <torch/torch.h>, or is fenced \`\`\`cpp fragment" <<<"$err" ||
  fail "the include problem: $err"
grep -qF "bad.md:5: \`\`\`cpp ignore: the only word allowed after cpp is 'fragment'" <<<"$err" ||
  fail "the fence problem: $err"
echo "doc_snippets_test: passed"
