#include "admin_console.h"

namespace kvrelay::proxy {

std::vector<AdminEndpoint> console_endpoints() {
  return {};
}

}  // namespace kvrelay::proxy
