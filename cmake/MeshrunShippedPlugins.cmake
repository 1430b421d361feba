# meshrun_shipped_plugin_targets(<out-var>)
#
# Sets <out-var> to every plugin target this project ships: the MODULE
# libraries named meshrun_* under plugins/, strategies/ and models/. Tests use
# it so that a new plugin is built before them and gets its conformance test
# without being listed anywhere. Call it after those directories are added.
function(meshrun_shipped_plugin_targets out_var)
  set(targets)
  set(dirs "${PROJECT_SOURCE_DIR}/plugins" "${PROJECT_SOURCE_DIR}/strategies"
    "${PROJECT_SOURCE_DIR}/models")
  while(dirs)
    list(POP_FRONT dirs dir)
    get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
    list(APPEND dirs ${subdirs})
    get_property(dir_targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target ${dir_targets})
      get_target_property(type ${target} TYPE)
      get_target_property(output_name ${target} OUTPUT_NAME)
      if(type STREQUAL "MODULE_LIBRARY" AND output_name MATCHES "^meshrun_")
        list(APPEND targets ${target})
      endif()
    endforeach()
  endwhile()
  set(${out_var} ${targets} PARENT_SCOPE)
endfunction()
