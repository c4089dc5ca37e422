// SPDX-License-Identifier: Apache-2.0
#include "orbite_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "common/nixl_log.h"

namespace orbite_nixl {

namespace {

constexpr uint64_t kConnectTimeoutMs = 10000;
// After a failed (re)connection, calls for that agent fail at once for
// this long instead of each waiting for a connect timeout.
constexpr int64_t kReconnectBackoffMs = 1000;
constexpr uint64_t kCloseTimeoutMs = 5000;
constexpr char kEnvelopeMagic[4] = {'O', 'N', 'F', '1'};
constexpr size_t kMaxAgentName = 4096;

// Copies a variable-length output of the C ABI into a string.
template <class F> OrbiteStatus fetchBytes(F call, std::string &out) {
    size_t needed = 0;
    OrbiteStatus s = call(nullptr, 0, &needed);
    if (s != ORBITE_STATUS_BUFFER_TOO_SMALL) return s;
    out.assign(needed, '\0');
    return call(reinterpret_cast<uint8_t *>(out.data()), out.size(), &needed);
}

// The epoch in a peer information blob ("ORBP", u16 version, u16 endpoint
// length, u64 epoch, endpoint; little-endian; docs/c-abi.md).
bool peerEpoch(const std::string &info, uint64_t &epoch) {
    if (info.size() < 16 || info.compare(0, 4, "ORBP") != 0) return false;
    epoch = 0;
    for (int i = 7; i >= 0; --i) epoch = (epoch << 8) | static_cast<uint8_t>(info[8 + i]);
    return true;
}

// Top-level keys of a JSON object, found by a small scanner (strings and
// nesting skipped). Returns false when `json` is not an object.
bool topLevelKeys(const std::string &json, std::vector<std::string> &keys, size_t &open) {
    size_t i = json.find_first_not_of(" \t\r\n");
    if (i == std::string::npos || json[i] != '{') return false;
    open = i;
    int depth = 0;
    bool expect_key = true;
    for (; i < json.size(); ++i) {
        char c = json[i];
        if (c == '"') {
            size_t start = ++i;
            while (i < json.size() && json[i] != '"') i += (json[i] == '\\') ? 2 : 1;
            if (i >= json.size()) return false;
            if (depth == 1 && expect_key) {
                keys.push_back(json.substr(start, i - start));
                expect_key = false;
            }
        } else if (c == '{' || c == '[') {
            ++depth;
            if (c == '{' && depth == 1) expect_key = true;
        } else if (c == '}' || c == ']') {
            --depth;
        } else if (c == ',' && depth == 1) {
            expect_key = true;
        }
    }
    return depth == 0;
}

} // namespace

std::string lastError() {
    size_t needed = 0;
    orbite_last_error(nullptr, 0, &needed);
    std::string s(needed, '\0');
    if (needed == 0 || orbite_last_error(s.data(), s.size(), &needed) != ORBITE_STATUS_OK) return {};
    s.resize(needed - 1);
    return s;
}

std::string wrapNotification(const std::string &agent, const std::string &payload) {
    std::string out(kEnvelopeMagic, 4);
    uint16_t n = static_cast<uint16_t>(agent.size());
    out.push_back(static_cast<char>(n & 0xff));
    out.push_back(static_cast<char>(n >> 8));
    out += agent;
    out += payload;
    return out;
}

bool unwrapNotification(const std::string &bytes, std::string &agent, std::string &payload) {
    if (bytes.size() < 6 || std::memcmp(bytes.data(), kEnvelopeMagic, 4) != 0) return false;
    size_t n = static_cast<uint8_t>(bytes[4]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[5])) << 8);
    if (bytes.size() < 6 + n) return false;
    agent.assign(bytes, 6, n);
    payload.assign(bytes, 6 + n, std::string::npos);
    return true;
}

nixl_status_t statusOf(const OrbiteXferState &s) {
    switch (s.state) {
    case ORBITE_STATE_NOT_POSTED: return NIXL_ERR_NOT_POSTED;
    case ORBITE_STATE_IN_PROGRESS: return NIXL_IN_PROG;
    default: break;
    }
    switch (s.code) {
    case ORBITE_OUTCOME_SUCCESS: return NIXL_SUCCESS;
    case ORBITE_OUTCOME_CANCELLED: return NIXL_ERR_CANCELED;
    default: return NIXL_ERR_BACKEND; // detail: detailOf()
    }
}

nixl_status_t statusOf(OrbiteStatus s) {
    switch (s) {
    case ORBITE_STATUS_OK: return NIXL_SUCCESS;
    case ORBITE_STATUS_INVALID_ARGUMENT:
    case ORBITE_STATUS_OUT_OF_RANGE:
    case ORBITE_STATUS_BUFFER_TOO_SMALL: return NIXL_ERR_INVALID_PARAM;
    case ORBITE_STATUS_NOT_SUPPORTED: return NIXL_ERR_NOT_SUPPORTED;
    case ORBITE_STATUS_NOT_ALLOWED:
    case ORBITE_STATUS_REFUSED: return NIXL_ERR_NOT_ALLOWED;
    case ORBITE_STATUS_ACTIVE: return NIXL_ERR_REPOST_ACTIVE;
    case ORBITE_STATUS_NOT_FOUND:
    case ORBITE_STATUS_STALE_HANDLE: return NIXL_ERR_NOT_FOUND;
    case ORBITE_STATUS_EPOCH_MISMATCH:
    case ORBITE_STATUS_WRONG_HANDLE:
    case ORBITE_STATUS_VERSION_MISMATCH: return NIXL_ERR_MISMATCH;
    case ORBITE_STATUS_REMOTE_DISCONNECT: return NIXL_ERR_REMOTE_DISCONNECT;
    default: return NIXL_ERR_BACKEND; // resource exhausted, closed, system, internal
    }
}

bool vramAvailable() {
    auto info = record<OrbiteAbiInfo>();
    return orbite_abi_info(&info) == ORBITE_STATUS_OK && (info.features & ORBITE_FEATURE_VRAM) != 0;
}

nixl_mem_list_t supportedMems() {
    if (vramAvailable()) return {DRAM_SEG, VRAM_SEG};
    return {DRAM_SEG};
}

bool addDefault(std::string &json, const std::string &key, const std::string &value,
                const std::vector<std::string> &unless, std::string &error) {
    std::vector<std::string> keys;
    size_t open = 0;
    if (!topLevelKeys(json, keys, open)) {
        error = "the 'config' parameter is not a JSON object";
        return false;
    }
    for (const auto &k : keys) {
        if (k == key || std::find(unless.begin(), unless.end(), k) != unless.end()) return true;
    }
    json.insert(open + 1, "\"" + key + "\": " + value + (keys.empty() ? " " : ", "));
    return true;
}

// The value `config` is advertised with (backendOptions): a caller that
// passes it back (nixlbench passes every advertised default) gave nothing.
bool isAdvertisedDefault(const std::string &value) {
    std::string compact;
    for (char c : value)
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') compact += c;
    return compact == "{}";
}

bool buildConfig(const nixlBackendInitParams &params, std::string &json, std::string &error) {
    bool given = false;
    if (params.customParams != nullptr) {
        for (const auto &[key, value] : *params.customParams) {
            if (key == "config") {
                if (isAdvertisedDefault(value)) continue;
                json = value;
                given = true;
            } else {
                error = "unknown ORBITE backend parameter '" + key + "' (only 'config', an OrbiTE JSON object)";
                return false;
            }
        }
    }
    if (!given) {
        // Created the way vLLM, Dynamo and LMCache create backends (no
        // parameters), or with the advertised defaults passed back: the
        // operator's configuration is in ORBITE_CONFIG.
        uint32_t origin = ORBITE_CONFIG_DEFAULTS;
        OrbiteStatus s = fetchBytes(
            [&](uint8_t *b, size_t c, size_t *n) { return orbite_config_document(&origin, b, c, n); }, json);
        if (s != ORBITE_STATUS_OK) {
            error = lastError();
            return false;
        }
    }
    std::vector<std::string> keys;
    size_t open = 0;
    if (!topLevelKeys(json, keys, open)) {
        error = "the 'config' parameter is not a JSON object";
        return false;
    }
    auto has = [&](const char *k) {
        for (const auto &key : keys)
            if (key == k) return true;
        return false;
    };
    std::string extra;
    auto add = [&](const std::string &kv) { extra += (extra.empty() ? "" : ", ") + kv; };
    if (params.enableProgTh) {
        if (has("progress_worker") || has("progress_interval_us")) {
            error = "enableProgTh/pthrDelay and the config's progress_worker/progress_interval_us both set";
            return false;
        }
        add("\"progress_worker\": true");
        if (params.pthrDelay > 0) add("\"progress_interval_us\": " + std::to_string(params.pthrDelay));
    }
    if (!extra.empty()) json.insert(open + 1, extra + (keys.empty() ? " " : ", "));
    return true;
}

namespace {

// One engine log record into NIXL's logger, at the matching level.
void toNixl(uint32_t level, const char *target, const char *message, void *) {
    switch (level) {
    case ORBITE_LOG_ERROR: NIXL_ERROR << target << ": " << message; break;
    case ORBITE_LOG_WARN: NIXL_WARN << target << ": " << message; break;
    case ORBITE_LOG_INFO: NIXL_INFO << target << ": " << message; break;
    case ORBITE_LOG_DEBUG: NIXL_DEBUG << target << ": " << message; break;
    default: NIXL_TRACE << target << ": " << message; break;
    }
}

// The engine's threshold for NIXL_LOG_LEVEL (as NIXL reads it: TRACE,
// DEBUG, INFO, WARN, ERROR, FATAL; WARN when unset or unknown), so the
// engine makes no record NIXL would drop.
uint32_t nixlThreshold() {
    const char *e = std::getenv("NIXL_LOG_LEVEL");
    if (e == nullptr) return ORBITE_LOG_WARN;
    const std::string v(e);
    if (v == "TRACE") return ORBITE_LOG_TRACE;
    if (v == "DEBUG") return ORBITE_LOG_DEBUG;
    if (v == "INFO") return ORBITE_LOG_INFO;
    if (v == "ERROR" || v == "FATAL") return ORBITE_LOG_ERROR;
    return ORBITE_LOG_WARN;
}

} // namespace

void forwardLogsToNixl() {
    static std::once_flag once;
    std::call_once(once, [] { orbite_log_install(&toNixl, nullptr, nixlThreshold()); });
}

Engine::Engine(const nixlBackendInitParams *init_params) : nixlBackendEngine(init_params) {
    // No exception leaves the constructor: any failure sets initErr, which
    // NIXL checks before using the engine.
    try {
        forwardLogsToNixl();
        std::string json;
        if (!buildConfig(*init_params, json, init_error_)) {
            NIXL_ERROR << "ORBITE: " << init_error_;
            initErr = true;
            return;
        }
        auto options = record<OrbiteEngineOptions>();
        options.abi_major = ORBITE_ABI_MAJOR;
        // As a deployment: without "listen" the engine listens on all
        // interfaces and advertises an address other hosts can reach.
        options.flags = ORBITE_ENGINE_DEPLOYMENT;
        options.required_features = ORBITE_FEATURE_TCP | ORBITE_FEATURE_NOTIFICATIONS;
        options.config_json = reinterpret_cast<const uint8_t *>(json.data());
        options.config_json_len = json.size();
        mems_ = supportedMems();
        OrbiteStatus s = orbite_engine_create(&options, &engine_);
        if (s == ORBITE_STATUS_OK) {
            uint32_t source = ORBITE_ADVERTISE_NONE;
            std::string line;
            if (fetchBytes([&](uint8_t *b, size_t c, size_t *n) { return orbite_engine_advertise(engine_, &source, b, c, n); },
                           line) == ORBITE_STATUS_OK) {
                if (source == ORBITE_ADVERTISE_LOOPBACK_FALLBACK) {
                    NIXL_WARN << "ORBITE: " << line;
                } else {
                    NIXL_INFO << "ORBITE: " << line;
                }
            }
            s = fetchBytes([&](uint8_t *b, size_t c, size_t *n) { return orbite_engine_export_peer(engine_, b, c, n); },
                           self_info_);
        }
        if (s == ORBITE_STATUS_OK) {
            uint64_t epoch = 0;
            peerEpoch(self_info_, epoch);
            self_ = std::make_shared<PeerSlot>(self_info_, epoch, true);
            s = orbite_peer_open(engine_, reinterpret_cast<const uint8_t *>(self_info_.data()), self_info_.size(),
                                 kConnectTimeoutMs, &self_->peer);
        }
        if (s != ORBITE_STATUS_OK) {
            init_error_ = lastError();
            NIXL_ERROR << "ORBITE: engine creation failed: " << init_error_;
            initErr = true;
        }
    } catch (const std::exception &e) {
        init_error_ = e.what();
        initErr = true;
    } catch (...) {
        init_error_ = "unknown exception";
        initErr = true;
    }
}

Engine::~Engine() {
    if (engine_.raw == 0) return;
    for (auto &[agent, slot] : peers_) {
        std::lock_guard<std::mutex> g(slot->mutex);
        if (slot->peer.raw != 0) orbite_peer_close(slot->peer, kCloseTimeoutMs);
        slot->peer = OrbitePeer{};
    }
    peers_.clear();
    if (self_ && self_->peer.raw != 0) orbite_peer_close(self_->peer, kCloseTimeoutMs);
    auto report = record<OrbiteCloseReport>();
    orbite_engine_close(engine_, kCloseTimeoutMs, &report);
    // Requests whose release NIXL saw refused: NIXL calls nothing on them
    // after destroying the backend.
    reap();
    for (Request *r : pending_) {
        if (r->xfer_released) {
            delete r;
        } else {
            NIXL_ERROR << "ORBITE: a request released while active never retired; its transfer is kept";
        }
    }
    pending_.clear();
    // Refused while registrations or requests NIXL never released are
    // alive: then the engine (and every owner it keeps) is deliberately
    // left in place rather than freed under work that may still run.
    if (orbite_engine_release(engine_) != ORBITE_STATUS_OK) {
        NIXL_ERROR << "ORBITE: engine kept alive at destruction: " << lastError();
    }
}

nixl_mem_list_t Engine::getSupportedMems() const { return mems_; }

nixl_status_t Engine::fail(OrbiteStatus s, const char *what) const {
    NIXL_DEBUG << "ORBITE: " << what << ": " << lastError();
    return statusOf(s);
}

nixl_status_t Engine::refuse(OrbiteStatus s, const char *what) const {
    // A registration or preparation refused is the caller's to fix: say
    // why where NIXL_LOG_LEVEL shows errors.
    NIXL_ERROR << "ORBITE: " << what << " refused: " << lastError();
    return statusOf(s);
}

nixl_status_t Engine::registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) {
    if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
    auto region = record<OrbiteMemRegion>();
    region.addr = mem.addr;
    region.len = mem.len;
    region.kind = ORBITE_MEM_DRAM;
    region.permission = ORBITE_PERM_REMOTE_READ_WRITE;
    if (nixl_mem == VRAM_SEG) {
        // NIXL's device id of VRAM is the CUDA ordinal. The engine checks
        // the range with the driver, or says why it takes no VRAM.
        if (mem.devId > UINT32_MAX) return NIXL_ERR_INVALID_PARAM;
        region.kind = ORBITE_MEM_VRAM;
        region.device = static_cast<uint32_t>(mem.devId);
    }
    OrbiteRegistration reg{};
    OrbiteStatus s = orbite_mem_register(engine_, &region, &reg);
    if (s != ORBITE_STATUS_OK) {
        if (nixl_mem == VRAM_SEG) {
            NIXL_WARN << "ORBITE: VRAM registration on device " << mem.devId << " refused: " << lastError();
            return statusOf(s);
        }
        return refuse(s, "registerMem");
    }
    std::string exported;
    s = fetchBytes([&](uint8_t *b, size_t c, size_t *n) { return orbite_mem_export(reg, b, c, n); }, exported);
    if (s != ORBITE_STATUS_OK) {
        orbite_mem_deregister(reg);
        return refuse(s, "registerMem export");
    }
    out = new (std::nothrow) LocalMD(reg, mem.addr, mem.len, std::move(exported));
    if (out == nullptr) {
        orbite_mem_deregister(reg);
        return NIXL_ERR_BACKEND;
    }
    return NIXL_SUCCESS;
}

nixl_status_t Engine::deregisterMem(nixlBackendMD *meta) {
    auto *md = dynamic_cast<LocalMD *>(meta);
    if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
    // Fences at once; the engine keeps the range until the last transfer
    // using it retired. NIXL's success here is not a release receipt.
    OrbiteStatus s = orbite_mem_deregister(md->reg);
    delete md;
    return s == ORBITE_STATUS_OK ? NIXL_SUCCESS : fail(s, "deregisterMem");
}

nixl_status_t Engine::getConnInfo(std::string &str) const {
    str = self_info_;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::loadRemoteConnInfo(const std::string &remote_agent, const std::string &remote_conn_info) {
    uint64_t epoch = 0;
    if (!peerEpoch(remote_conn_info, epoch)) return NIXL_ERR_INVALID_PARAM;
    std::shared_ptr<PeerSlot> old;
    {
        std::lock_guard<std::mutex> g(mutex_);
        auto it = peers_.find(remote_agent);
        if (it != peers_.end()) {
            if (it->second->info == remote_conn_info) return NIXL_SUCCESS;
            old = it->second;
        }
        peers_[remote_agent] = std::make_shared<PeerSlot>(remote_conn_info, epoch, false);
    }
    // A new identity for a known agent (a restarted engine): fence the old
    // one; requests prepared for it keep it and cannot be reposted.
    if (old) closeSlot(*old);
    return NIXL_SUCCESS;
}

void Engine::closeSlot(PeerSlot &slot) {
    std::lock_guard<std::mutex> g(slot.mutex);
    // No wait: admitted work keeps the engine's peer until it retired,
    // then the peer goes with the last transfer that holds it.
    if (slot.peer.raw != 0 && orbite_peer_close(slot.peer, 0) != ORBITE_STATUS_OK) {
        NIXL_DEBUG << "ORBITE: peer closed with work still draining: " << lastError();
    }
    slot.peer = OrbitePeer{};
}

nixl_status_t Engine::peerFor(const std::string &agent, std::shared_ptr<PeerSlot> &slot, OrbitePeer &out) const {
    if (agent == localAgent) {
        slot = self_;
        out = self_->peer;
        return NIXL_SUCCESS;
    }
    {
        std::lock_guard<std::mutex> g(mutex_);
        auto it = peers_.find(agent);
        if (it == peers_.end()) return NIXL_ERR_NOT_FOUND;
        slot = it->second;
    }
    // Only this agent's slot is held while its peer is checked or opened.
    std::lock_guard<std::mutex> g(slot->mutex);
    if (slot->peer.raw != 0 && orbite_peer_check(slot->peer) != ORBITE_STATUS_OK) {
        // Lost (the network failed, the peer stopped answering): work that
        // was admitted fails on the old peer; new work gets a new
        // connection to the same incarnation. Nothing is replayed.
        NIXL_INFO << "ORBITE: reconnecting to " << agent << ": " << lastError();
        orbite_peer_close(slot->peer, 0);
        slot->peer = OrbitePeer{};
    }
    if (slot->peer.raw == 0) {
        auto now = std::chrono::steady_clock::now();
        if (now < slot->retry_after) return NIXL_ERR_REMOTE_DISCONNECT; // failed moments ago
        const std::string &info = slot->info;
        OrbiteStatus s = orbite_peer_open(engine_, reinterpret_cast<const uint8_t *>(info.data()), info.size(),
                                          kConnectTimeoutMs, &slot->peer);
        if (s != ORBITE_STATUS_OK) {
            slot->peer = OrbitePeer{};
            slot->retry_after = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReconnectBackoffMs);
            return fail(s, "connect");
        }
    }
    out = slot->peer;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::connect(const std::string &remote_agent) {
    std::shared_ptr<PeerSlot> slot;
    OrbitePeer p{};
    return peerFor(remote_agent, slot, p);
}

nixl_status_t Engine::disconnect(const std::string &remote_agent) {
    if (remote_agent == localAgent) return NIXL_SUCCESS;
    std::shared_ptr<PeerSlot> slot;
    {
        std::lock_guard<std::mutex> g(mutex_);
        auto it = peers_.find(remote_agent);
        if (it == peers_.end()) return NIXL_ERR_NOT_FOUND;
        slot = it->second;
        peers_.erase(it);
    }
    closeSlot(*slot);
    return NIXL_SUCCESS;
}

nixl_status_t Engine::getPublicData(const nixlBackendMD *meta, std::string &str) const {
    auto *md = dynamic_cast<const LocalMD *>(meta);
    if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
    str = md->exported;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &nixl_mem,
                                   const std::string &remote_agent, nixlBackendMD *&output) {
    // The peer's description says what memory the range is; the engine
    // routes (and stages) by it.
    if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
    std::shared_ptr<PeerSlot> slot;
    OrbitePeer peer{};
    nixl_status_t st = peerFor(remote_agent, slot, peer);
    if (st != NIXL_SUCCESS) return st;
    // The peer confirms the range (refreshing this engine's view of it when
    // the range was registered after the peer was opened).
    auto range = record<OrbiteRemoteRange>();
    OrbiteStatus s = orbite_peer_import_range(peer, reinterpret_cast<const uint8_t *>(input.metaInfo.data()),
                                              input.metaInfo.size(), &range);
    if (s != ORBITE_STATUS_OK) return refuse(s, "loadRemoteMD");
    if (input.addr < range.addr || input.len > range.len || input.addr - range.addr > range.len - input.len) {
        return NIXL_ERR_INVALID_PARAM;
    }
    output = new (std::nothrow) RemoteMD(slot, remote_agent, range);
    return output == nullptr ? NIXL_ERR_BACKEND : NIXL_SUCCESS;
}

nixl_status_t Engine::loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) {
    auto *md = dynamic_cast<LocalMD *>(input);
    if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
    // A distinct wrapper over the same registration: unloading it never
    // deregisters the source.
    auto range = record<OrbiteRemoteRange>();
    OrbiteStatus s = orbite_mem_remote_range(md->reg, &range);
    if (s != ORBITE_STATUS_OK) return refuse(s, "loadLocalMD");
    output = new (std::nothrow) RemoteMD(self_, localAgent, range);
    return output == nullptr ? NIXL_ERR_BACKEND : NIXL_SUCCESS;
}

nixl_status_t Engine::unloadMD(nixlBackendMD *input) {
    auto *md = dynamic_cast<RemoteMD *>(input);
    if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
    // A lookup wrapper only: admitted transfers keep their own leases.
    delete md;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::prepare(Request &r) const {
    auto spec = record<OrbiteXferSpec>();
    spec.op = r.op;
    spec.peer = r.peer;
    spec.local = r.local.data();
    spec.local_count = r.local.size();
    spec.remote = r.remote.data();
    spec.remote_count = r.remote.size();
    if (r.by_address) spec.flags |= ORBITE_XFER_REMOTE_BY_ADDRESS;
    if (r.notification) {
        spec.flags |= ORBITE_XFER_NOTIFY;
        spec.notification = reinterpret_cast<const uint8_t *>(r.notification->data());
        spec.notification_len = r.notification->size();
    }
    OrbiteXfer x{};
    OrbiteStatus s = orbite_xfer_prepare(engine_, &spec, &x);
    if (s != ORBITE_STATUS_OK) return refuse(s, "prepXfer");
    r.xfer = x;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                               const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                               nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args) const {
    // Every pairing of DRAM and VRAM: the engine picks the route and stages
    // device memory where the route needs it.
    auto memory = [](nixl_mem_t m) { return m == DRAM_SEG || m == VRAM_SEG; };
    if (!memory(local.getType()) || !memory(remote.getType())) return NIXL_ERR_NOT_SUPPORTED;
    if (opt_args != nullptr && !opt_args->customParam.empty()) {
        NIXL_ERROR << "ORBITE: customParam is not understood and is refused";
        return NIXL_ERR_INVALID_PARAM;
    }
    auto r = std::make_unique<Request>();
    r->op = operation == NIXL_WRITE ? ORBITE_OP_WRITE : ORBITE_OP_READ;
    std::shared_ptr<PeerSlot> slot;
    nixl_status_t st = peerFor(remote_agent, slot, r->peer);
    if (st != NIXL_SUCCESS) return st;
    // A peer's ranges are named by address and resolved against its
    // current description; our own by the registration we hold.
    r->by_address = !slot->self;
    r->local.reserve(local.descCount());
    for (const auto &d : local) {
        auto *md = dynamic_cast<const LocalMD *>(d.metadataP);
        if (md == nullptr || d.addr < md->addr) return NIXL_ERR_INVALID_PARAM;
        r->local.push_back(OrbiteDesc{md->reg.raw, d.addr - md->addr, d.len});
    }
    r->remote.reserve(remote.descCount());
    for (const auto &d : remote) {
        auto *md = dynamic_cast<const RemoteMD *>(d.metadataP);
        if (md == nullptr || d.addr < md->range.addr) return NIXL_ERR_INVALID_PARAM;
        if (md->slot != slot) return NIXL_ERR_MISMATCH; // another agent's (or incarnation's) metadata
        if (r->by_address) {
            r->remote.push_back(OrbiteDesc{0, d.addr, d.len});
        } else {
            r->remote.push_back(OrbiteDesc{md->range.remote_registration, d.addr - md->range.addr, d.len});
        }
    }
    if (opt_args != nullptr && opt_args->hasNotif) r->notification = wrapNotification(localAgent, opt_args->notifMsg);
    st = prepare(*r);
    if (st != NIXL_SUCCESS) return st;
    handle = r.release();
    return NIXL_SUCCESS;
}

nixl_status_t Engine::postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
                               const std::string &, nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args) const {
    auto *r = dynamic_cast<Request *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    if (r->xfer_released) return NIXL_ERR_NOT_ALLOWED; // its release was asked for
    if (opt_args != nullptr && !opt_args->customParam.empty()) return NIXL_ERR_INVALID_PARAM;
    std::optional<std::string> notification;
    if (opt_args != nullptr && opt_args->hasNotif) notification = wrapNotification(localAgent, opt_args->notifMsg);
    if (notification != r->notification) {
        // The notification is fixed at prepare: re-prepare, but only where a
        // post would be allowed (never after a failure, never while active).
        auto st = record<OrbiteXferState>();
        OrbiteStatus s = orbite_xfer_query(r->xfer, &st);
        if (s != ORBITE_STATUS_OK) return fail(s, "postXfer");
        if (st.state == ORBITE_STATE_IN_PROGRESS) return NIXL_ERR_REPOST_ACTIVE;
        if (st.state == ORBITE_STATE_RETIRED && st.code != ORBITE_OUTCOME_SUCCESS) return NIXL_ERR_NOT_ALLOWED;
        Request fresh;
        fresh.op = r->op;
        fresh.peer = r->peer;
        fresh.by_address = r->by_address;
        fresh.local = r->local;
        fresh.remote = r->remote;
        fresh.notification = notification;
        nixl_status_t pst = prepare(fresh);
        if (pst != NIXL_SUCCESS) return pst;
        orbite_xfer_release(r->xfer);
        r->xfer = fresh.xfer;
        r->notification = std::move(notification);
    }
    OrbiteStatus s = orbite_xfer_post(r->xfer);
    if (s != ORBITE_STATUS_OK) return fail(s, "postXfer");
    return checkXfer(handle);
}

void Engine::reap() const {
    if (pending_count_.load(std::memory_order_acquire) == 0) return;
    std::lock_guard<std::mutex> g(pending_mutex_);
    for (Request *r : pending_) {
        if (r->xfer_released) continue;
        auto st = record<OrbiteXferState>();
        if (orbite_xfer_query(r->xfer, &st) != ORBITE_STATUS_OK || st.state == ORBITE_STATE_IN_PROGRESS) continue;
        r->final_status = statusOf(st);
        r->detail = XferDetail{st.state,      st.code,           st.remote_effect,   st.drained, st.route,
                               st.transferred_prefix, st.transferred_bytes, st.total_bytes, st.execution};
        noteEnd(*r, r->final_status);
        r->xfer_released = orbite_xfer_release(r->xfer) == ORBITE_STATUS_OK;
    }
}

void Engine::noteEnd(Request &r, nixl_status_t status) const {
    if (status >= 0 || status == NIXL_ERR_NOT_POSTED || r.telemetry_execution == r.detail.execution) return;
    // One telemetry event per failed execution, its own outcome counted
    // once (the queue is the base class's: bounded, locked, kept only with
    // telemetry on).
    r.telemetry_execution = r.detail.execution;
    auto type = status == NIXL_ERR_CANCELED ? nixl_telemetry_event_type_t::AGENT_ERR_CANCELED
                                            : nixl_telemetry_event_type_t::AGENT_ERR_BACKEND;
    const_cast<Engine *>(this)->addTelemetryEvent(type, 1);
}

nixl_status_t Engine::checkXfer(nixlBackendReqH *handle) const {
    auto *r = dynamic_cast<Request *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    reap();
    if (r->xfer_released) return r->final_status;
    auto st = record<OrbiteXferState>();
    OrbiteStatus s = orbite_xfer_query(r->xfer, &st);
    if (s != ORBITE_STATUS_OK) return fail(s, "checkXfer");
    r->detail = XferDetail{st.state,      st.code,           st.remote_effect,   st.drained, st.route,
                           st.transferred_prefix, st.transferred_bytes, st.total_bytes, st.execution};
    nixl_status_t out = statusOf(st);
    if (out < 0 && out != NIXL_ERR_NOT_POSTED) {
        NIXL_DEBUG << "ORBITE: transfer ended with outcome " << st.code << ", prefix " << st.transferred_prefix
                   << " of " << st.total_bytes << ", effect " << st.remote_effect;
        noteEnd(*r, out);
    }
    return out;
}

nixl_status_t Engine::cancelXfer(nixlBackendReqH *handle) const {
    auto *r = dynamic_cast<Request *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    if (r->xfer_released) return NIXL_SUCCESS; // already retired
    OrbiteStatus s = orbite_xfer_cancel(r->xfer);
    return s == ORBITE_STATUS_OK ? NIXL_SUCCESS : fail(s, "cancelXfer");
}

const XferDetail &Engine::detailOf(const nixlBackendReqH *handle) {
    static const XferDetail none{};
    auto *r = dynamic_cast<const Request *>(handle);
    return r == nullptr ? none : r->detail;
}

nixl_status_t Engine::releaseReqH(nixlBackendReqH *handle) const {
    auto *r = dynamic_cast<Request *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    reap();
    std::lock_guard<std::mutex> g(pending_mutex_);
    auto it = std::find(pending_.begin(), pending_.end(), r);
    OrbiteStatus s = r->xfer_released ? ORBITE_STATUS_OK : orbite_xfer_release(r->xfer);
    if (s == ORBITE_STATUS_ACTIVE) {
        // Refused (negative) while an execution is active, and nothing is
        // cancelled. The request stays pollable; should NIXL drop it
        // anyway (NIXL 1.5 deletes a request whose release failed when it
        // is released again), its transfer is released once it retired.
        if (it == pending_.end()) {
            pending_.push_back(r);
            pending_count_.fetch_add(1, std::memory_order_acq_rel);
        }
        return NIXL_ERR_REPOST_ACTIVE;
    }
    if (s != ORBITE_STATUS_OK) return fail(s, "releaseReqH");
    if (it != pending_.end()) {
        pending_.erase(it);
        pending_count_.fetch_sub(1, std::memory_order_acq_rel);
    }
    delete r;
    return NIXL_SUCCESS;
}

nixl_status_t Engine::genNotif(const std::string &remote_agent, const std::string &msg) const {
    std::shared_ptr<PeerSlot> slot;
    OrbitePeer peer{};
    nixl_status_t st = peerFor(remote_agent, slot, peer);
    if (st != NIXL_SUCCESS) return st;
    std::string bytes = wrapNotification(localAgent, msg);
    OrbiteStatus s = orbite_notify(peer, reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size());
    return s == ORBITE_STATUS_OK ? NIXL_SUCCESS : fail(s, "genNotif");
}

nixl_status_t Engine::getNotifs(notif_list_t &notif_list) {
    reap();
    std::string buf(64 * 1024, '\0');
    for (;;) {
        auto res = record<OrbiteDrainResult>();
        OrbiteStatus s = orbite_notifs_drain(engine_, reinterpret_cast<uint8_t *>(buf.data()), buf.size(), &res);
        if (s == ORBITE_STATUS_BUFFER_TOO_SMALL) {
            buf.assign(res.next_needed, '\0');
            continue;
        }
        if (s != ORBITE_STATUS_OK) return fail(s, "getNotifs");
        uint64_t at = 0;
        auto view = record<OrbiteNotifView>();
        while (orbite_notif_next(reinterpret_cast<const uint8_t *>(buf.data()), res.written, &at, &view) ==
               ORBITE_STATUS_OK) {
            std::string agent, payload;
            std::string bytes(reinterpret_cast<const char *>(view.payload), view.payload_len);
            if (!unwrapNotification(bytes, agent, payload) || agent.size() > kMaxAgentName) {
                NIXL_WARN << "ORBITE: dropped a notification without a valid envelope";
                continue;
            }
            // A sender we know by another incarnation is stale: drop it.
            {
                std::lock_guard<std::mutex> g(mutex_);
                auto it = peers_.find(agent);
                if (it != peers_.end() && it->second->epoch != view.sender_epoch) {
                    NIXL_WARN << "ORBITE: dropped a notification from a stale incarnation of " << agent;
                    continue;
                }
            }
            notif_list.emplace_back(std::move(agent), std::move(payload));
        }
        if (res.next_needed == 0) return NIXL_SUCCESS;
    }
}

nixl_status_t Engine::queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
    return NIXL_ERR_NOT_SUPPORTED;
}

} // namespace orbite_nixl
