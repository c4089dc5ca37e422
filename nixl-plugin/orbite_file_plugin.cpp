// SPDX-License-Identifier: Apache-2.0
// Plugin entry points of the local-only ORBITE_FILE backend.
#include "backend/backend_plugin.h"
#include "orbite_backend.h"
#include "orbite_file_backend.h"

namespace {

nixlBackendEngine *createEngine(const nixlBackendInitParams *init_params) {
    try {
        return new orbite_nixl::FileEngine(init_params);
    } catch (...) {
        return nullptr;
    }
}

void destroyEngine(nixlBackendEngine *engine) { delete engine; }
const char *pluginName() { return "ORBITE_FILE"; }
const char *pluginVersion() { return "0.1.0"; }
nixl_b_params_t backendOptions() { return {{"config", "{}"}}; }
nixl_mem_list_t backendMems() {
    // VRAM moves to and from files through the engine's staging buffers
    // where the library has a CUDA device.
    if (orbite_nixl::vramAvailable()) return {DRAM_SEG, VRAM_SEG, FILE_SEG};
    return {DRAM_SEG, FILE_SEG};
}

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION, createEngine, destroyEngine, pluginName,
                            pluginVersion,           backendOptions, backendMems};

} // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init() { return &plugin; }

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
