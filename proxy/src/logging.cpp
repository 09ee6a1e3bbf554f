#include "kvrelay/proxy/logging.h"

#include <fmt/format.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace kvrelay::proxy {

Status configure_logging(const LoggingPolicy& logging) {
  spdlog::drop("kvrelay");
  std::shared_ptr<spdlog::logger> logger;
  try {
    if (logging.file.empty()) {
      logger = spdlog::stderr_color_mt("kvrelay");
    } else {
      logger = spdlog::basic_logger_mt("kvrelay", logging.file);
    }
  } catch (const spdlog::spdlog_ex& error) {
    return fail(ErrorCode::kIo, fmt::format("logging to '{}': {}", logging.file, error.what()));
  }
  if (logging.format == "json") {
    // Messages are ours and never contain raw quotes from input unescaped by callers.
    logger->set_pattern(R"({"ts":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","pid":%P,"msg":"%v"})");
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ kvrelay[%P] %v");
  }
  logger->set_level(spdlog::level::from_str(logging.level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return ok();
}

}  // namespace kvrelay::proxy
