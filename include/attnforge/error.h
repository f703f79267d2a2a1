// attnforge reports every failure as attnforge::Error. Messages name the argument, its value and what would be
// accepted, e.g. "q: dtype float8_e4m3 is not accepted; expected one of {float32, float16, bfloat16}".
#pragma once

#include <stdexcept>
#include <string>

namespace attnforge {

enum class ErrorKind {
  kInvalidArgument,  // a value, shape, dtype or stride the caller passed is wrong
  kUnsupported,      // valid input this build or device cannot run (supports() says why)
  kWorkspace,        // the workspace is smaller than the plan needs
  kPlanMismatch,     // run() got metadata of another batch than the plan was made for
  kBackend,          // a device runtime call failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace attnforge
