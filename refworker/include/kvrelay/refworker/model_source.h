#pragma once

#include <cstdint>
#include <string>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/model.h"

namespace kvrelay::refworker {

// Where a worker's weights come from: a llama2.c checkpoint path or a synthetic shape + seed.
struct ModelSource {
  std::string checkpoint_path;
  std::string synthetic_shape;
  std::uint64_t seed = 0;
};

// Loads the checkpoint, or builds the synthetic model; exactly one of the two must be set.
[[nodiscard]] Result<Model> load_model(const ModelSource& source);

}  // namespace kvrelay::refworker
