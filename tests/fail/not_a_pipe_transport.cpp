// A transport that moves messages but cannot begin a step is not one a pipe can run over: the
// pipe could not tell it the step's plan and skip routes. PipeOver must say which concept failed
// and which expression is missing.
// expect-error: pipe_transport
// expect-error: t.begin_step(plan, routes)
#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"

#include <exception>
#include <optional>
#include <string>
#include <vector>

struct NoBeginStep {
  void send(const stagewise::runtime::MessageKey& k, stagewise::runtime::Message m) {
    mail.send(k, std::move(m));
  }
  std::optional<stagewise::runtime::Message> recv(const stagewise::runtime::MessageKey& k) {
    return mail.recv(k);
  }
  void abort(std::exception_ptr e) { mail.abort(e); }
  stagewise::runtime::Processes processes() const { return {}; }
  std::vector<std::string> gather(const std::string&, const std::string& mine) { return {mine}; }
  torch::Tensor share(const torch::Tensor& value, int, int) { return value; }
  void end_step() {}
  std::exception_ptr error() const { return mail.error(); }
  stagewise::runtime::Traffic traffic() const { return {}; }
  stagewise::runtime::MailboxTransport mail;
};

int main() {
  static_assert(stagewise::runtime::transport<NoBeginStep>);  // a transport, but not a pipe's
  stagewise::PipeOver<NoBeginStep>* pipe = nullptr;
  (void)pipe;
}
