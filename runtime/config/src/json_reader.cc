#include "json_reader.h"

#include <cmath>
#include <limits>

#include "zinf/core/units.h"

namespace zinf::config::detail {

using nlohmann::json;

std::string join_path(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  return fmt::format("{}.{}", parent, key);
}

std::string describe(const json& v) {
  constexpr size_t kMaxChars = 60;
  std::string text = v.dump();
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars - 3) + "...";
  switch (v.type()) {
    case json::value_t::string:
      return text + " (a string)";
    case json::value_t::boolean:
      return text + " (a boolean)";
    case json::value_t::array:
      return text + " (an array)";
    case json::value_t::object:
      return text + " (an object)";
    case json::value_t::null:
      return "null";
    default:
      return text;
  }
}

Status type_error(std::string_view path, std::string_view what, const json& v) {
  return make_error(ErrorCode::kInvalidArgument, "{}: expected {}, got {}", path, what,
                    describe(v));
}

std::optional<int64_t> as_int(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (hi < 0 || u > static_cast<uint64_t>(hi)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) return std::nullopt;
    return i;
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    // Whole numbers only; the bounds are compared in double, where 2^63 is exact.
    if (!std::isfinite(d) || d != std::floor(d)) return std::nullopt;
    if (d < static_cast<double>(lo) || d >= 9223372036854775808.0) return std::nullopt;
    auto i = static_cast<int64_t>(d);
    if (i > hi) return std::nullopt;
    return i;
  }
  return std::nullopt;
}

std::optional<uint64_t> as_uint(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return std::nullopt;
    return static_cast<uint64_t>(i);
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || d < 0 || d >= 18446744073709551616.0) {
      return std::nullopt;
    }
    return static_cast<uint64_t>(d);
  }
  return std::nullopt;
}

ObjectReader::ObjectReader(const json& object, std::string path, ParseState& state)
    : object_(&object), path_(std::move(path)), state_(&state) {}

const json* ObjectReader::find(std::string_view key) {
  known_.emplace(key);
  auto it = object_->find(std::string(key));
  if (it == object_->end() || it->is_null()) return nullptr;
  if (!(it->is_string() && it->get_ref<const std::string&>() == "auto")) {
    state_->given_keys.insert(key_path(key));
  }
  return &*it;
}

void ObjectReader::mark_given(std::string_view key) { state_->given_keys.insert(key_path(key)); }

void ObjectReader::record_ignored(std::string_view key) {
  state_->ignored_keys.push_back(key_path(key));
}

bool ObjectReader::given(std::string_view key) {
  const json* v = find(key);
  return v != nullptr && !(v->is_string() && v->get_ref<const std::string&>() == "auto");
}

void ObjectReader::ignore(std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) known_.emplace(k);
}

Result<const json*> ObjectReader::value(std::string_view key, Auto a, std::string_view what) {
  const json* v = find(key);
  if (v == nullptr) return static_cast<const json*>(nullptr);
  if (v->is_string() && v->get_ref<const std::string&>() == "auto") {
    if (a == Auto::kRefused) {
      return type_error(key_path(key), fmt::format("{} (\"auto\" is not accepted here)", what), *v);
    }
    state_->auto_keys.push_back(key_path(key));
    return static_cast<const json*>(nullptr);
  }
  return v;
}

Status ObjectReader::read_bool(std::string_view key, bool& out, Auto a) {
  constexpr std::string_view kWhat = "true or false";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  if (!v->is_boolean()) return type_error(key_path(key), kWhat, *v);
  out = v->get<bool>();
  return Status::ok();
}

Status ObjectReader::read_int(std::string_view key, int64_t& out, Auto a) {
  constexpr std::string_view kWhat = "an integer";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  auto i = as_int(*v, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
  if (!i) return type_error(key_path(key), kWhat, *v);
  out = *i;
  return Status::ok();
}

Status ObjectReader::read_int(std::string_view key, int& out, Auto a) {
  constexpr std::string_view kWhat = "a 32-bit integer";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  auto i = as_int(*v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  if (!i) return type_error(key_path(key), kWhat, *v);
  out = static_cast<int>(*i);
  return Status::ok();
}

Status ObjectReader::read_uint(std::string_view key, uint64_t& out, Auto a) {
  constexpr std::string_view kWhat = "a non-negative integer";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  auto u = as_uint(*v);
  if (!u) return type_error(key_path(key), kWhat, *v);
  out = *u;
  return Status::ok();
}

Status ObjectReader::read_double(std::string_view key, double& out, Auto a) {
  constexpr std::string_view kWhat = "a number";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  if (!v->is_number()) return type_error(key_path(key), kWhat, *v);
  out = v->get<double>();
  return Status::ok();
}

Status ObjectReader::read_float(std::string_view key, float& out, Auto a) {
  constexpr std::string_view kWhat = "a number in single-precision range";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  if (!v->is_number()) return type_error(key_path(key), kWhat, *v);
  double d = v->get<double>();
  if (!(std::fabs(d) <= std::numeric_limits<float>::max())) {
    return type_error(key_path(key), kWhat, *v);
  }
  out = static_cast<float>(d);
  return Status::ok();
}

Status ObjectReader::read_bytes(std::string_view key, uint64_t& out, Auto a) {
  constexpr std::string_view kWhat = "a byte count (an integer, or a string such as \"4G\")";
  ZINF_ASSIGN_OR_RETURN(const json* v, value(key, a, kWhat));
  if (v == nullptr) return Status::ok();
  if (v->is_string()) {
    Result<uint64_t> bytes = parse_bytes(v->get_ref<const std::string&>());
    if (!bytes) {
      return make_error(ErrorCode::kInvalidArgument, "{}: expected {}, got {}: {}", key_path(key),
                        kWhat, describe(*v), bytes.status().message());
    }
    out = *bytes;
    return Status::ok();
  }
  auto u = as_uint(*v);
  if (!u) return type_error(key_path(key), kWhat, *v);
  out = *u;
  return Status::ok();
}

Status ObjectReader::read_string(std::string_view key, std::string& out) {
  const json* v = find(key);
  if (v == nullptr) return Status::ok();
  if (!v->is_string()) return type_error(key_path(key), "a string", *v);
  out = v->get<std::string>();
  return Status::ok();
}

Result<std::optional<ObjectReader>> ObjectReader::object(std::string_view key) {
  const json* v = find(key);
  if (v == nullptr) return std::optional<ObjectReader>();
  if (!v->is_object()) return type_error(key_path(key), "an object", *v);
  return std::optional<ObjectReader>(ObjectReader(*v, key_path(key), *state_));
}

void ObjectReader::finish() {
  for (const auto& [key, value] : object_->items()) {
    if (!known_.contains(key)) state_->unknown_keys.push_back(key_path(key));
  }
}

}  // namespace zinf::config::detail
