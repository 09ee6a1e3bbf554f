#pragma once

// The data path reports failure through values, never exceptions. Result<T> is Boost.Outcome's
// result with our Error as the failure type; it is [[nodiscard]] and terminates on misuse
// (reading the value of a failed result), which turns logic errors into loud crashes in tests.

#include <boost/outcome/result.hpp>
#include <boost/outcome/try.hpp>

#include "kvrelay/core/error.h"

namespace kvrelay {

namespace outcome = BOOST_OUTCOME_V2_NAMESPACE;

template <class T>
using Result = outcome::basic_result<T, Error, outcome::policy::terminate>;

using Status = Result<void>;

[[nodiscard]] inline auto fail(ErrorCode code, std::string message) {
  return outcome::failure(Error{code, std::move(message)});
}

[[nodiscard]] inline auto ok() {
  return outcome::success();
}

}  // namespace kvrelay

// Propagates a failed Result out of the enclosing function; binds the value otherwise.
#define KVRELAY_TRY(...) BOOST_OUTCOME_TRY(__VA_ARGS__)
