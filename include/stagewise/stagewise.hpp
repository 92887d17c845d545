#pragma once

// stagewise: memory-efficient pipeline-parallel training for LibTorch. Umbrella header.

#include "stagewise/core/batch.hpp"
#include "stagewise/core/dependency.hpp"
#include "stagewise/core/phony.hpp"
#include "stagewise/coro/generator.hpp"
#include "stagewise/optim/clip.hpp"
#include "stagewise/optim/fused_step.hpp"
#include "stagewise/optim/optimizer_for.hpp"
