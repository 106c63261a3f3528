// Optional config.json fields, read with the checks and messages every family shares: a field that
// is absent or null takes transformers' default; one of the wrong type is an error naming the file
// and the key.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace spindle {

inline int64_t positive_int_or(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
    fail("{}: \"{}\" must be a positive integer, got {}", source, key, j[key].dump());
  return j[key].get<int64_t>();
}

inline double number_or(const nlohmann::json& j, const char* key, double fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) fail("{}: \"{}\" must be a number, got {}", source, key, j[key].dump());
  return j[key].get<double>();
}

inline bool bool_or(const nlohmann::json& j, const char* key, bool fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) fail("{}: \"{}\" must be true or false, got {}", source, key, j[key].dump());
  return j[key].get<bool>();
}

// Whether config.json sets partial_rotary_factor (top level, or in rope_parameters / rope_scaling):
// families whose transformers class defaults it to another value than 1 apply their own otherwise.
inline bool has_partial_rotary_factor(const nlohmann::json& j) {
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (j.contains(key) && j[key].is_object() && j[key].contains("partial_rotary_factor")) return true;
  return j.contains("partial_rotary_factor") && !j["partial_rotary_factor"].is_null();
}

}  // namespace spindle
