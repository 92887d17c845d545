// A type with send and recv but no abort is not a transport: the executor could not stop the
// other stages when one fails. run_programs must say which concept failed.
// expect-error: transport
// expect-error: t.abort(e)
#include "stagewise/runtime/program_executor.hpp"

#include <memory>
#include <optional>
#include <vector>

struct NoAbort {
  void send(const stagewise::runtime::MessageKey&, stagewise::runtime::Message) {}
  std::optional<stagewise::runtime::Message> recv(const stagewise::runtime::MessageKey&) {
    return std::nullopt;
  }
};

int main() {
  std::vector<std::unique_ptr<stagewise::runtime::StageRuntime>> stages;
  stagewise::schedule::Plan plan;
  stagewise::runtime::TrainStep step;
  NoAbort mail;
  std::vector<stagewise::Worker*> workers;
  stagewise::runtime::run_programs(stages, plan, step, mail, workers);
}
