#pragma once

// stagewise's distributed form: stages in separate processes over c10d. Needs c10d's Gloo headers
// (Debian: libgloo-dev) and -DUSE_C10D_GLOO; in Bazel depend on //:distributed.

#include "stagewise/pipe/distributed/data_parallel.hpp"
#include "stagewise/pipe/distributed/measure_link.hpp"
#include "stagewise/pipe/distributed/options.hpp"
#include "stagewise/pipe/distributed/pipe.hpp"
#include "stagewise/pipe/distributed/sharded.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/startup.hpp"
#include "stagewise/runtime/c10d/subgroup.hpp"
#include "stagewise/runtime/c10d/transport.hpp"
#include "stagewise/schedule/comms.hpp"
