#pragma once

// stagewise: memory-efficient pipeline-parallel training for LibTorch. Umbrella header.

#include "stagewise/core/batch.hpp"
#include "stagewise/core/dependency.hpp"
#include "stagewise/core/phony.hpp"
#include "stagewise/coro/generator.hpp"
