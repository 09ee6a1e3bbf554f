#pragma once

// WRR against FIFO on one link: the real decision::LinkScheduler, driven by step() on its virtual
// clock, with low-priority bulk transfers keeping the link busy and urgent high-priority ones
// arriving among them. Reports the urgent transfers' completion delays under each mode, and
// with the link otherwise idle as the floor.

#include <nlohmann/json.hpp>

#include <cstdint>

namespace kvrelay::sim {

[[nodiscard]] nlohmann::json run_scheduler_comparison(std::uint64_t seed);

}  // namespace kvrelay::sim
