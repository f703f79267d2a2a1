# Header-only dependencies: from the system (Debian packages, installed by scripts/install-deps) or, on machines
# that have none of them and no network (the GPU machine), from ATTNFORGE_DEPS_DIR/include, a copy of the
# headers that scripts/device-check carries along (fmt, CLI, nlohmann, dlpack, xxhash.h). fmt is always used header-only, so no binary depends on a
# libfmt of one distribution.
set(ATTNFORGE_DEPS_DIR "" CACHE PATH "Folder whose include/ holds fmt, CLI11, nlohmann/json and dlpack headers")
if(NOT ATTNFORGE_DEPS_DIR AND EXISTS ${CMAKE_SOURCE_DIR}/.deps/include)
  set(ATTNFORGE_DEPS_DIR ${CMAKE_SOURCE_DIR}/.deps)  # the copy scripts/device-check documents (pip builds too)
endif()

function(attnforge_header_dep name header)
  find_path(${name}_INCLUDE_DIR ${header} HINTS ${ATTNFORGE_DEPS_DIR}/include)
  if(NOT ${name}_INCLUDE_DIR)
    message(FATAL_ERROR "attnforge: ${header} not found; run scripts/install-deps, or set ATTNFORGE_DEPS_DIR to a "
                        "folder whose include/ holds it")
  endif()
  add_library(attnforge_dep_${name} INTERFACE)
  target_include_directories(attnforge_dep_${name} INTERFACE ${${name}_INCLUDE_DIR})
endfunction()

attnforge_header_dep(fmt fmt/format.h)
target_compile_definitions(attnforge_dep_fmt INTERFACE FMT_HEADER_ONLY=1)
attnforge_header_dep(dlpack dlpack/dlpack.h)
if(ATTNFORGE_BUILD_CLI)
  attnforge_header_dep(cli11 CLI/CLI.hpp)
  attnforge_header_dep(json nlohmann/json.hpp)
endif()
attnforge_header_dep(xxhash xxhash.h)  # the kernel cache's content hash, used header-only (XXH_INLINE_ALL)
find_package(Threads REQUIRED)
