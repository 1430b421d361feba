// A stage setup of a whole model as the model ABI takes it, for tests that
// call a model plugin's table directly rather than through the core's
// ModelStage: every module, no communicators, and hooks no call may reach
// (their functions are NULL: only calls refused before any compute, and
// stage_create, can run over them).
#pragma once

#include <vector>

#include "meshrun/model.h"
#include "model/model.hpp"

struct RawStageSetup {
  RawStageSetup(const meshrun::Model& model, DLDevice device) {
    for (const auto& module : model.description().modules) modules.push_back(module.name.c_str());
    hooks.struct_size = sizeof(hooks);
    setup.struct_size = sizeof(setup);
    setup.num_modules = int64_t(modules.size());
    setup.modules = modules.data();
    setup.hooks = &hooks;
    setup.plan_json = "{}";
    setup.options_json = "{}";
    setup.device = device;
  }
  RawStageSetup(const RawStageSetup&) = delete;
  RawStageSetup& operator=(const RawStageSetup&) = delete;

  std::vector<const char*> modules;
  meshrun_model_hooks hooks{};
  meshrun_model_stage_setup setup{};
};
