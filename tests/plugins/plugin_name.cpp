#include "plugin_name.hpp"

namespace test_plugins {

const char kPluginName[] = TEST_PLUGIN_NAME;

}  // namespace test_plugins
