// A skip namespace must be a class type (a tag): skip<int, "x"> must not compile.
// expect-error: skip_namespace
#include "stagewise/skip/namespace.hpp"

using bad = stagewise::skip<int, "x">;

int main() {
  return bad::name().size() > 0 ? 0 : 1;
}
