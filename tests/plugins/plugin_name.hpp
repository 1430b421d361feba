// The name a test plugin variant is built as. The variants of a body
// (test_plugin.cpp, test_sidecar.cpp, test_model.cpp) share its one compiled
// object and differ only by plugin_name.cpp, compiled per variant with
// TEST_PLUGIN_NAME, so the body reads its name here at run time.
#pragma once

namespace test_plugins {

extern const char kPluginName[];

}  // namespace test_plugins
