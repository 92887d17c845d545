// The distributed headers compiled without USE_C10D_GLOO (a user who included them but depends on
// //:stagewise instead of //:distributed): the #error names the define and the target to use.
// expect-error: compile with -DUSE_C10D_GLOO
// expect-error: depend on //:distributed
#include "stagewise/distributed.hpp"

int main() { return 0; }
