#pragma once

// Test helpers: small checkers for the SVG and JSON that stagewise writes.

#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

namespace stagewise::testing {

/// A path for a scratch file: in Bazel's TEST_TMPDIR, else /tmp.
inline std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

/// Number of times `part` occurs in `text`.
inline std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto p = text.find(part); p != std::string::npos; p = text.find(part, p + part.size())) ++n;
  return n;
}

/// Whether `xml` is one element whose tags all open and close in order (no DTD, no CDATA).
inline bool balanced_xml(const std::string& xml) {
  std::vector<std::string> open;
  int roots = 0;
  for (std::size_t p = xml.find('<'); p != std::string::npos; p = xml.find('<', p + 1)) {
    const auto end = xml.find('>', p);
    if (end == std::string::npos) return false;
    std::string tag = xml.substr(p + 1, end - p - 1);
    if (tag.empty()) return false;
    if (tag.front() == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) return false;
      open.pop_back();
    } else if (tag.back() != '/') {
      if (open.empty()) ++roots;
      open.push_back(tag.substr(0, tag.find_first_of(" \n\t")));
    } else if (open.empty()) {
      ++roots;
    }
    if (xml.find('<', p + 1) != std::string::npos && xml.find('<', p + 1) < end) return false;
  }
  return open.empty() && roots == 1;
}

namespace detail {
struct Json {
  const std::string& s;
  std::size_t p = 0;
  void space() {
    while (p < s.size() && std::isspace(static_cast<unsigned char>(s[p]))) ++p;
  }
  bool literal(const char* word) {
    const std::string w(word);
    if (s.compare(p, w.size(), w) != 0) return false;
    p += w.size();
    return true;
  }
  bool string() {
    if (p >= s.size() || s[p] != '"') return false;
    for (++p; p < s.size(); ++p) {
      if (s[p] == '\\') {
        ++p;
      } else if (s[p] == '"') {
        ++p;
        return true;
      }
    }
    return false;
  }
  bool number() {
    const std::size_t start = p;
    if (p < s.size() && s[p] == '-') ++p;
    while (p < s.size() && (std::isdigit(static_cast<unsigned char>(s[p])) || s[p] == '.' ||
                            s[p] == 'e' || s[p] == 'E' || s[p] == '+' || s[p] == '-')) {
      ++p;
    }
    return p > start;
  }
  bool value() {
    space();
    if (p >= s.size()) return false;
    bool ok = false;
    switch (s[p]) {
      case '{':
        ok = members('}', true);
        break;
      case '[':
        ok = members(']', false);
        break;
      case '"':
        ok = string();
        break;
      case 't':
        ok = literal("true");
        break;
      case 'f':
        ok = literal("false");
        break;
      case 'n':
        ok = literal("null");
        break;
      default:
        ok = number();
    }
    space();
    return ok;
  }
  bool members(char close, bool object) {
    ++p;
    space();
    if (p < s.size() && s[p] == close) return ++p, true;
    for (;;) {
      if (object) {
        space();
        if (!string()) return false;
        space();
        if (p >= s.size() || s[p++] != ':') return false;
      }
      if (!value()) return false;
      if (p >= s.size()) return false;
      if (s[p] == close) return ++p, true;
      if (s[p++] != ',') return false;
    }
  }
};
}  // namespace detail

/// Whether `text` is one well-formed JSON value.
inline bool valid_json(const std::string& text) {
  detail::Json j{text};
  return j.value() && j.p == text.size();
}

}  // namespace stagewise::testing
