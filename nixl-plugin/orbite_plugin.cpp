// SPDX-License-Identifier: Apache-2.0
// Plugin entry points of the ORBITE backend. Everything that depends on the
// NIXL plugin API version lives in this file.
#include "backend/backend_plugin.h"
#include "orbite_backend.h"

namespace {

const char kName[] = "ORBITE";
const char kVersion[] = "0.1.0";

nixlBackendEngine *createEngine(const nixlBackendInitParams *init_params) {
    // No exception crosses the factory: a failed construction is reported
    // through the engine's init error, which NIXL checks.
    try {
        return new orbite_nixl::Engine(init_params);
    } catch (...) {
        return nullptr;
    }
}

void destroyEngine(nixlBackendEngine *engine) { delete engine; }

const char *pluginName() { return kName; }
const char *pluginVersion() { return kVersion; }

nixl_b_params_t backendOptions() {
    // One parameter: the OrbiTE engine's JSON configuration.
    return {{"config", "{}"}};
}

// VRAM_SEG too when the library takes device memory (docs/nixl-plugin.md).
nixl_mem_list_t backendMems() { return orbite_nixl::supportedMems(); }

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION, createEngine, destroyEngine, pluginName,
                            pluginVersion,           backendOptions, backendMems};

} // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init() { return &plugin; }

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
