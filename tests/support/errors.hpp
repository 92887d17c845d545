#pragma once

// Test helper: the message of the c10::Error (or std::exception) a callable throws.

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>

namespace stagewise::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace stagewise::testing
