// Typed, path-aware reading of one JSON object of the configuration (internal to zinf_config).
//
// Contract of every read_*(key, out): when the key is absent, null, or the string "auto" (where
// "auto" is allowed, recorded in ParseState::auto_keys), `out` keeps its value (the default) and
// the result is ok; when the value has the wrong JSON type or cannot be represented in `out`, the
// result is an error "<path>: expected <what>, got <value>". Value ranges are not checked here:
// check.cc holds those rules, so they apply equally to a Config built in code.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::config::detail {

struct ParseState {
  std::vector<std::string> unknown_keys;
  std::vector<std::string> auto_keys;
  std::vector<std::string> ignored_keys;  // accepted-but-ignored keys the document sets
  std::set<std::string> given_keys;       // every key with a value (not null, not "auto")
};

// "parent.key", or "key" at the top level.
std::string join_path(std::string_view parent, std::string_view key);
// A short rendering of a JSON value for error messages: "\"3\" (a string)", "true (a boolean)".
std::string describe(const nlohmann::json& v);
// "<path>: expected <what>, got <describe(v)>".
Status type_error(std::string_view path, std::string_view what, const nlohmann::json& v);

enum class Auto { kAllowed, kRefused };

class ObjectReader {
 public:
  // `object` must be a JSON object and outlive the reader.
  ObjectReader(const nlohmann::json& object, std::string path, ParseState& state);

  const std::string& path() const { return path_; }
  const nlohmann::json& json_object() const { return *object_; }
  const ParseState& state() const { return *state_; }
  std::string key_path(std::string_view key) const { return join_path(path_, key); }

  // The value of `key`, or nullptr when absent or null. Marks the key as known, and as given
  // (ParseState::given_keys) when its value is not "auto".
  const nlohmann::json* find(std::string_view key);
  // Records `key` of this object as given although the document spelled it otherwise (an alias,
  // a deprecated switch): given_keys then holds the canonical path too.
  void mark_given(std::string_view key);
  // Whether `key` is present with a value other than null and "auto". Marks the key as known.
  bool given(std::string_view key);
  // Marks keys as known without reading them or checking them (DeepSpeed derives them).
  void ignore(std::initializer_list<std::string_view> keys);
  // Records `key` of this object in ParseState::ignored_keys: an accepted-but-ignored key the
  // document sets (its caller checked the type).
  void record_ignored(std::string_view key);

  Status read_bool(std::string_view key, bool& out, Auto a = Auto::kAllowed);
  // Integers: JSON integers, or numbers written as whole floats (5e8), as DeepSpeed accepts.
  Status read_int(std::string_view key, int64_t& out, Auto a = Auto::kAllowed);
  Status read_int(std::string_view key, int& out, Auto a = Auto::kAllowed);
  // Non-negative integers (sizes, counts); a negative value is a type error.
  Status read_uint(std::string_view key, uint64_t& out, Auto a = Auto::kAllowed);
  Status read_double(std::string_view key, double& out, Auto a = Auto::kAllowed);
  // A number that must be finite in single precision.
  Status read_float(std::string_view key, float& out, Auto a = Auto::kAllowed);
  // A byte count: a non-negative integer, or a string parse_bytes() reads ("4G", "512MiB").
  Status read_bytes(std::string_view key, uint64_t& out, Auto a = Auto::kAllowed);
  Status read_string(std::string_view key, std::string& out);

  // A nested object: std::nullopt when absent or null; an error when not an object.
  Result<std::optional<ObjectReader>> object(std::string_view key);

  // The raw value of `key` for a caller that converts it itself: nullptr when there is nothing
  // to read (absent, null, or an allowed "auto", which is recorded); an error naming `what` when
  // the value is "auto" and a is kRefused.
  Result<const nlohmann::json*> value(std::string_view key, Auto a, std::string_view what);

  // Records every key of the object that was not found, read or ignored as unknown.
  void finish();

 private:
  const nlohmann::json* object_;
  std::string path_;
  ParseState* state_;
  std::set<std::string, std::less<>> known_;
};

// Converts a JSON number that must be an integer in [lo, hi]; nullopt when it is not one.
std::optional<int64_t> as_int(const nlohmann::json& v, int64_t lo, int64_t hi);
std::optional<uint64_t> as_uint(const nlohmann::json& v);

}  // namespace zinf::config::detail
