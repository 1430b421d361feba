# meshrun_add_plugin(<target> KIND <strategy|schedule|sidecar|comm|model> NAME <name>
#                    SOURCES <files...> [LINK <libraries...>])
#
# Builds a meshrun plugin: a MODULE library named meshrun_<kind>_<name>.so
# that exports exactly one symbol, meshrun_plugin_get_api (hidden visibility,
# a version script, and -Wl,--no-undefined so a plugin never depends on
# libmeshrun's symbols). Used by this project and, installed with the package,
# by out-of-tree plugins after find_package(meshrun).
function(meshrun_add_plugin target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "KIND;NAME" "SOURCES;LINK")
  if(NOT arg_KIND MATCHES "^(strategy|schedule|sidecar|comm|model)$")
    message(FATAL_ERROR "meshrun_add_plugin(${target}): KIND must be strategy, schedule, sidecar, comm or model, not '${arg_KIND}'")
  endif()
  if(NOT arg_NAME MATCHES "^[a-z0-9_]+$")
    message(FATAL_ERROR "meshrun_add_plugin(${target}): NAME must match [a-z0-9_]+, not '${arg_NAME}'")
  endif()
  set(version_script "${CMAKE_CURRENT_BINARY_DIR}/${target}.map")
  file(WRITE "${version_script}" "{\n  global: meshrun_plugin_get_api;\n  local: *;\n};\n")
  add_library(${target} MODULE ${arg_SOURCES})
  if(TARGET meshrun::abi)
    target_link_libraries(${target} PRIVATE meshrun::abi)
  endif()
  target_link_libraries(${target} PRIVATE ${arg_LINK})
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    OUTPUT_NAME "meshrun_${arg_KIND}_${arg_NAME}"
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LINK_DEPENDS "${version_script}")
  target_link_options(${target} PRIVATE "-Wl,--version-script=${version_script}" "-Wl,--no-undefined")
  if(DEFINED MESHRUN_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${MESHRUN_PLUGIN_OUTPUT_DIR}")
  endif()
endfunction()
