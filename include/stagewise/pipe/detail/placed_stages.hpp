#pragma once

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <utility>

namespace stagewise::detail {

// The module base of both pipes (stagewise::PipeImpl, distributed::PipeImpl): each stage lives on
// the device the pipe placed it on, so moving the whole pipe to a device is refused with an error
// naming `who`; changing the dtype of every parameter is allowed.
class PlacedStages : public torch::nn::Module {
 public:
  explicit PlacedStages(std::string who) : who_(std::move(who)) {}

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    refuse_move(device);
    (void)dtype;
    (void)non_blocking;
  }
  void to(torch::Device device, bool non_blocking = false) override {
    refuse_move(device);
    (void)non_blocking;
  }
  /// Changing the dtype of every parameter is allowed.
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(dtype, non_blocking);
  }

 private:
  [[noreturn]] void refuse_move(torch::Device device) const {
    TORCH_CHECK(false, who_, ": cannot move the pipe to ", device.str(),
                ": each stage lives on the device it was given. Build the pipe with "
                "PipeOptions().devices(...) to place stages elsewhere (changing the dtype is "
                "allowed).");
  }

  std::string who_;
};

}  // namespace stagewise::detail
