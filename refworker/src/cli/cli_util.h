#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/model_source.h"

namespace kvrelay::refworker::cli {

// --model PATH | --synthetic SHAPE [--seed N], shared by every subcommand.
void add_model_options(CLI::App& command, ModelSource& source);

// --blas-threads N (default 1): OpenBLAS threads. One thread per worker keeps decode fast and
// timings stable when workers and sidecars share a few cores; raise it on an idle many-core host.
void add_blas_threads_option(CLI::App& command, int& threads);
void apply_blas_threads(int threads);

// "1,2,3" -> {1,2,3}.
[[nodiscard]] Result<std::vector<std::int32_t>> parse_token_list(const std::string& text);

// Prints "error: <code>: <message>" to stderr and returns exit status 1.
int report_error(const Error& error);

}  // namespace kvrelay::refworker::cli
