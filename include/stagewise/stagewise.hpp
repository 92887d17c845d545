#pragma once

// stagewise: memory-efficient pipeline-parallel training for LibTorch. Umbrella header.

#include "stagewise/autograd/parallel_branches.hpp"
#include "stagewise/core/batch.hpp"
#include "stagewise/core/dependency.hpp"
#include "stagewise/core/phony.hpp"
#include "stagewise/coro/generator.hpp"
#include "stagewise/nn/parallel_branches.hpp"
#include "stagewise/runtime/thread_pool.hpp"
#include "stagewise/runtime/thread_state.hpp"
