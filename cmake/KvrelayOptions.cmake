option(KVRELAY_BUILD_TESTS "Build the Catch2 test suite" ON)
option(KVRELAY_BUILD_BENCH "Build the benchmarks in bench/" ON)
option(KVRELAY_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
option(KVRELAY_WERROR "Treat compiler warnings as errors" OFF)
option(KVRELAY_FUZZ "Build libFuzzer targets (needs clang)" OFF)
option(KVRELAY_PCH "Precompile the heavy third-party headers (Asio, Beast, nlohmann/json, fmt, spdlog, Catch2) per target" ON)
set(KVRELAY_CUDA "AUTO" CACHE STRING "Build CUDA kernels: AUTO (when nvcc is found), ON or OFF")
set_property(CACHE KVRELAY_CUDA PROPERTY STRINGS AUTO ON OFF)
# Line tables keep sanitizer and crash stack traces symbolized while compiling heavy Beast/Asio/Catch2
# translation units about a quarter to a third faster than full -g (measured on front_proxy.cpp);
# choose "full" for a debugging session.
# "none" is for CI's optimised pass, which only needs pass/fail (the ASan pass keeps line tables).
set(KVRELAY_DEBUG_INFO "lines" CACHE STRING "Debug info in Debug/RelWithDebInfo builds: lines (-g1), full (-g) or none")
set_property(CACHE KVRELAY_DEBUG_INFO PROPERTY STRINGS lines full none)

# GNU ld takes ~2.5x as long as lld to link our Boost-heavy executables (kvrelay under ASan:
# 11.4 -> 4.1 s; proxy_unit_tests 5.5 -> 2.3 s), and a CI run links ~25 of them per preset.
option(KVRELAY_USE_LLD "Link C/C++ executables with lld when the compiler accepts -fuse-ld=lld" ON)
if(KVRELAY_USE_LLD)
  include(CheckLinkerFlag)
  check_linker_flag(CXX "-fuse-ld=lld" KVRELAY_HAVE_LLD)
  if(KVRELAY_HAVE_LLD)
    add_link_options($<$<LINK_LANGUAGE:C,CXX>:-fuse-ld=lld>)
  endif()
endif()

# Fuzz builds instrument some libraries' parsers (coverage, ASan, UBSan); every executable that
# links them, not only the fuzz targets, then needs the sanitizer runtimes.
if(KVRELAY_FUZZ)
  add_link_options($<$<LINK_LANGUAGE:C,CXX>:-fsanitize=address,undefined>)
endif()

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "Build type" FORCE)
endif()

if(KVRELAY_DEBUG_INFO STREQUAL "lines")
  add_compile_options($<$<AND:$<COMPILE_LANGUAGE:C,CXX>,$<CONFIG:Debug,RelWithDebInfo>>:-g1>)
elseif(KVRELAY_DEBUG_INFO STREQUAL "none")
  add_compile_options($<$<AND:$<COMPILE_LANGUAGE:C,CXX>,$<CONFIG:Debug,RelWithDebInfo>>:-g0>)
elseif(NOT KVRELAY_DEBUG_INFO STREQUAL "full")
  message(FATAL_ERROR "KVRELAY_DEBUG_INFO must be lines, full or none, not '${KVRELAY_DEBUG_INFO}'")
endif()

# Warnings for project targets only; third-party headers come in as SYSTEM.
add_library(kvrelay_warnings INTERFACE)
target_compile_options(kvrelay_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wconversion -Wsign-conversion -Wshadow
                            -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
                            -Wimplicit-fallthrough>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVRELAY_WERROR}>>:-Werror>)

# UBSan's vptr check instruments every member access of polymorphic types, which Asio and Beast
# are full of: leaving it out compiles the heaviest translation units ~16% faster and keeps CI
# under its time budget; every other UBSan check stays on.
if(KVRELAY_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=all
                      -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=all)
endif()

# Helper: one library per top-level folder, public headers under include/kvrelay/<folder>/.
function(kvrelay_add_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(kvrelay_${name} ${ARG_SOURCES})
  add_library(kvrelay::${name} ALIAS kvrelay_${name})
  target_include_directories(kvrelay_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(kvrelay_${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE kvrelay_warnings ${ARG_PRIVATE_DEPS})
  install(DIRECTORY include/ DESTINATION include)
endfunction()

# Parsing Asio, Beast, nlohmann/json and Catch2 is about 40% of compiling one of our heavier files
# (front_proxy.cpp, upstream_relay_test.cpp: 16.5 -> 9.3 s with a precompiled header). A target's
# header is built with that target's own flags, so it is always valid for it. Only third-party
# and standard headers belong in the list: a project header there would rebuild everything.
function(kvrelay_precompile target)
  if(KVRELAY_PCH)
    target_precompile_headers(${target} PRIVATE ${ARGN})
  endif()
endfunction()

