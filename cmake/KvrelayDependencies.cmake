# All dependencies come from Debian 12 packages; scripts/install-deps.sh installs them.
find_package(Threads REQUIRED)
find_package(Boost 1.81 REQUIRED CONFIG)
find_package(nlohmann_json 3.11 REQUIRED)
find_package(spdlog 1.10 REQUIRED)
find_package(CLI11 2.1 REQUIRED)
find_package(zstd REQUIRED)
find_package(OpenSSL 3 REQUIRED)  # TLS on the peer plane, HMAC of the signed kvrelay fields
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)

# Targets with uniform names so components can link them without caring where they came from.
add_library(kvrelay_dep_xxhash INTERFACE)
target_link_libraries(kvrelay_dep_xxhash INTERFACE PkgConfig::XXHASH)
add_library(kvrelay::dep::xxhash ALIAS kvrelay_dep_xxhash)
# XXH3_64bits of the packaged library is its portable SSE2 build (~14 GB/s here); on x86 the
# library also exports XXH3_*_dispatch, which runs its AVX2 / AVX-512 build when the CPU has one
# (same hash values, ~2.3x faster in cache). Code that hashes bulk data includes
# xxh_x86dispatch.h where KVRELAY_HAVE_XXH3_DISPATCH is true (kvrelay/core/bulk_hash.h).
include(CheckSymbolExists)
set(CMAKE_REQUIRED_LIBRARIES PkgConfig::XXHASH)
check_symbol_exists(XXH3_64bits_dispatch "xxh_x86dispatch.h" KVRELAY_HAVE_XXH3_DISPATCH)
unset(CMAKE_REQUIRED_LIBRARIES)
if(KVRELAY_HAVE_XXH3_DISPATCH)
  target_compile_definitions(kvrelay_dep_xxhash INTERFACE KVRELAY_HAVE_XXH3_DISPATCH=1)
endif()

add_library(kvrelay_dep_zstd INTERFACE)
if(TARGET zstd::libzstd_shared)
  target_link_libraries(kvrelay_dep_zstd INTERFACE zstd::libzstd_shared)
else()
  target_link_libraries(kvrelay_dep_zstd INTERFACE zstd::libzstd_static)
endif()
add_library(kvrelay::dep::zstd ALIAS kvrelay_dep_zstd)

# Boost.Asio/Beast are header-only; keep their heavy templates out of most translation units.
add_library(kvrelay_dep_boost INTERFACE)
target_link_libraries(kvrelay_dep_boost INTERFACE Boost::headers Threads::Threads)
target_compile_definitions(kvrelay_dep_boost INTERFACE
  BOOST_ASIO_NO_DEPRECATED)
add_library(kvrelay::dep::boost ALIAS kvrelay_dep_boost)

# UCX (issue #29): the optional peer transport. Debian 12's libucx-dev 1.13; without it the
# build still succeeds, `peers[].transport: "ucx"` is refused at start and the ucx tests skip.
pkg_check_modules(UCX IMPORTED_TARGET ucx>=1.13)
add_library(kvrelay_dep_ucx INTERFACE)
if(UCX_FOUND)
  target_link_libraries(kvrelay_dep_ucx INTERFACE PkgConfig::UCX)
  target_compile_definitions(kvrelay_dep_ucx INTERFACE KVRELAY_HAVE_UCX=1)
  message(STATUS "kvrelay: UCX ${UCX_VERSION}: the ucx peer transport is built")
else()
  message(STATUS "kvrelay: no UCX (libucx-dev): the ucx peer transport is not built")
endif()
add_library(kvrelay::dep::ucx ALIAS kvrelay_dep_ucx)
