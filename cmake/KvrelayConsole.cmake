# The web console (issue #30, docs/console.md): proxy/console/console.html, plain HTML with its
# CSS and JS inline, is embedded into kvrelay_proxy as a C++ raw string literal in a generated
# header, kvrelay_console_page.h. No build step touches the page itself: what is in the file is
# what the browser gets (the Content-Security-Policy hashes its <script> and <style> blocks at
# start-up, proxy/src/admin_console.cpp).
#
# Included from proxy/CMakeLists.txt after kvrelay_proxy is declared. The same file is also the
# generator, run at build time in script mode (cmake -P) whenever the page changes:
#   cmake -DKVRELAY_CONSOLE_INPUT=page.html -DKVRELAY_CONSOLE_OUTPUT=header.h -P KvrelayConsole.cmake

set(kvrelay_console_delimiter "kvrelay_console")

if(CMAKE_SCRIPT_MODE_FILE)
  file(READ "${KVRELAY_CONSOLE_INPUT}" kvrelay_console_text)
  string(FIND "${kvrelay_console_text}" ")${kvrelay_console_delimiter}\"" kvrelay_console_clash)
  if(NOT kvrelay_console_clash EQUAL -1)
    message(FATAL_ERROR "${KVRELAY_CONSOLE_INPUT} contains the raw string delimiter "
                        "')${kvrelay_console_delimiter}\"'; it cannot be embedded")
  endif()
  file(WRITE "${KVRELAY_CONSOLE_OUTPUT}.tmp"
       "// Generated from ${KVRELAY_CONSOLE_INPUT} by cmake/KvrelayConsole.cmake. Do not edit.\n"
       "#pragma once\n\n#include <string_view>\n\n"
       "namespace kvrelay::proxy::console_assets {\n\n"
       "inline constexpr std::string_view kConsolePage = R\"${kvrelay_console_delimiter}("
       "${kvrelay_console_text})${kvrelay_console_delimiter}\";\n\n"
       "}  // namespace kvrelay::proxy::console_assets\n")
  # Rewritten only when it changed, so that an unchanged page recompiles nothing.
  file(COPY_FILE "${KVRELAY_CONSOLE_OUTPUT}.tmp" "${KVRELAY_CONSOLE_OUTPUT}" ONLY_IF_DIFFERENT)
  file(REMOVE "${KVRELAY_CONSOLE_OUTPUT}.tmp")
  return()
endif()

set(KVRELAY_CONSOLE_PAGE ${PROJECT_SOURCE_DIR}/proxy/console/console.html)
set(KVRELAY_CONSOLE_GENERATED_DIR ${PROJECT_BINARY_DIR}/proxy/console_generated)
add_custom_command(
  OUTPUT ${KVRELAY_CONSOLE_GENERATED_DIR}/kvrelay_console_page.h
  COMMAND ${CMAKE_COMMAND} -DKVRELAY_CONSOLE_INPUT=${KVRELAY_CONSOLE_PAGE}
          -DKVRELAY_CONSOLE_OUTPUT=${KVRELAY_CONSOLE_GENERATED_DIR}/kvrelay_console_page.h
          -P ${CMAKE_CURRENT_LIST_FILE}
  DEPENDS ${KVRELAY_CONSOLE_PAGE} ${CMAKE_CURRENT_LIST_FILE}
  COMMENT "Embedding the web console (proxy/console/console.html)"
  VERBATIM)
target_sources(kvrelay_proxy PRIVATE ${KVRELAY_CONSOLE_GENERATED_DIR}/kvrelay_console_page.h)
target_include_directories(kvrelay_proxy PRIVATE ${KVRELAY_CONSOLE_GENERATED_DIR})
