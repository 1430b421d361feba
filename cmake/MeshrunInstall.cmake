# Installation and the CMake package that plugin authors use:
#
#   find_package(meshrun REQUIRED)
#   meshrun_add_plugin(my_plugin KIND strategy NAME my_strategy SOURCES my_strategy.c)
#
# The package provides the imported targets meshrun::abi (the C headers) and
# meshrun::meshrun (libmeshrun, the host API), the meshrun_add_plugin()
# function, and MESHRUN_PLUGIN_INSTALL_DIR (the installed plugin folder, which
# `meshrun` searches first). Included last by the top-level CMakeLists.txt, so
# every target of the build exists here. Libraries, programs and plugins are
# installed where they are defined.
include(CMakePackageConfigHelpers)

set(MESHRUN_CMAKE_INSTALL_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/meshrun")

install(EXPORT meshrunTargets
  NAMESPACE meshrun::
  FILE meshrunTargets.cmake
  DESTINATION "${MESHRUN_CMAKE_INSTALL_DIR}")

# The headers need DLPack's only once they include <dlpack/dlpack.h>, which
# meshrun::abi then states by linking dlpack::dlpack.
get_target_property(MESHRUN_ABI_LINKS meshrun_abi INTERFACE_LINK_LIBRARIES)
if(MESHRUN_ABI_LINKS MATCHES "dlpack")
  set(MESHRUN_FIND_DEPENDENCIES "find_dependency(dlpack)")
else()
  set(MESHRUN_FIND_DEPENDENCIES "")
endif()

set(MESHRUN_PLUGIN_INSTALL_DIR "${MESHRUN_PLUGIN_SUBDIR}")
configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/meshrunConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/meshrunConfig.cmake"
  INSTALL_DESTINATION "${MESHRUN_CMAKE_INSTALL_DIR}"
  PATH_VARS MESHRUN_PLUGIN_INSTALL_DIR)
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/meshrunConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion)
install(FILES
  "${PROJECT_BINARY_DIR}/meshrunConfig.cmake"
  "${PROJECT_BINARY_DIR}/meshrunConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/MeshrunPlugin.cmake"
  DESTINATION "${MESHRUN_CMAKE_INSTALL_DIR}")
