// SPDX-License-Identifier: Apache-2.0
// The NIXL plugin's own parsers behind a C interface for the fuzz targets.
// orbite_backend.cpp is included whole, so that the functions in its
// anonymous namespace (peerEpoch, topLevelKeys) are the plugin's own code;
// each wrapper catches every exception, since a throw must not cross into
// Rust (the plugin's callers catch them too).
#include "orbite_backend.cpp"

#include <cstring>

namespace {

// Copies `s` into `out` (up to `cap` bytes) and returns its full length.
size_t copyOut(const std::string &s, char *out, size_t cap) {
    std::memcpy(out, s.data(), s.size() < cap ? s.size() : cap);
    return s.size();
}

} // namespace

// 1 and the epoch if the plugin takes `info` as peer information, 0 if
// not, -1 on an exception.
extern "C" int orbite_fuzz_peer_epoch(const char *info, size_t len, uint64_t *epoch) {
    try {
        return orbite_nixl::peerEpoch(std::string(info, len), *epoch) ? 1 : 0;
    } catch (...) {
        return -1;
    }
}

// 1 if the plugin unwraps `bytes` as a notification envelope (the agent
// name's and payload's lengths written), 0 if not, -1 on an exception.
extern "C" int orbite_fuzz_unwrap_notification(const char *bytes, size_t len, size_t *agent_len,
                                               size_t *payload_len) {
    try {
        std::string agent, payload;
        if (!orbite_nixl::unwrapNotification(std::string(bytes, len), agent, payload)) return 0;
        *agent_len = agent.size();
        *payload_len = payload.size();
        return 1;
    } catch (...) {
        return -1;
    }
}

// The plugin's envelope of (agent, payload): its full length, of which at
// most `cap` bytes are written to `out`; 0 on an exception.
extern "C" size_t orbite_fuzz_wrap_notification(const char *agent, size_t agent_len, const char *payload,
                                                size_t payload_len, char *out, size_t cap) {
    try {
        return copyOut(orbite_nixl::wrapNotification(std::string(agent, agent_len), std::string(payload, payload_len)),
                       out, cap);
    } catch (...) {
        return 0;
    }
}

// Runs the plugin's addDefault(json, key, value, {}) on `json`: 1 and the
// resulting document's full length (at most `cap` bytes of it in `out`)
// if it accepted the document, 0 if it refused it, -1 on an exception.
extern "C" int orbite_fuzz_add_default(const char *json, size_t len, const char *key, size_t key_len,
                                       const char *value, size_t value_len, char *out, size_t cap,
                                       size_t *out_len) {
    try {
        std::string doc(json, len), error;
        if (!orbite_nixl::addDefault(doc, std::string(key, key_len), std::string(value, value_len), {}, error)) {
            return 0;
        }
        *out_len = copyOut(doc, out, cap);
        return 1;
    } catch (...) {
        return -1;
    }
}
