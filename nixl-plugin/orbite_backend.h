// SPDX-License-Identifier: Apache-2.0
// The NIXL backend "ORBITE": a thin adapter over OrbiTE's C ABI
// (liborbite_nixl). It converts NIXL descriptors and statuses and calls the
// ABI; it has no thread, queue, scheduler or retry of its own. See
// docs/nixl-plugin.md.
#ifndef ORBITE_NIXL_BACKEND_H
#define ORBITE_NIXL_BACKEND_H

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend_engine.h"

#include <orbite/nixl.h>

namespace orbite_nixl {

// A C ABI record with its size and version set, everything else zero.
template <class T> T record() {
    T r{};
    r.size = sizeof(T);
    r.version = ORBITE_RECORD_VERSION;
    return r;
}

// What the adapter knows about a finished request beyond NIXL's status: the
// logical outcome and the retirement receipt, kept apart.
struct XferDetail {
    uint32_t state = ORBITE_STATE_NOT_POSTED;
    uint32_t code = ORBITE_OUTCOME_SUCCESS;
    uint32_t remote_effect = ORBITE_EFFECT_NONE;
    uint32_t drained = 0;
    uint32_t route = 0;
    uint64_t transferred_prefix = 0;
    uint64_t transferred_bytes = 0;
    uint64_t total_bytes = 0;
    uint64_t execution = 0;
};

// Metadata of a local registration.
class LocalMD : public nixlBackendMD {
public:
    LocalMD(OrbiteRegistration reg, uint64_t addr, uint64_t len, std::string exported)
        : nixlBackendMD(true), reg(reg), addr(addr), len(len), exported(std::move(exported)) {}
    OrbiteRegistration reg;
    uint64_t addr;
    uint64_t len;
    std::string exported; // range metadata for peers (getPublicData)
};

// One agent this backend talks to: its connection info, and the engine
// peer opened from it. The slot's mutex is held only while this agent's
// peer is looked at, opened or closed: a slow or dead peer never stalls
// another agent, getNotifs or the backend's map.
struct PeerSlot {
    PeerSlot(std::string info, uint64_t epoch, bool self) : info(std::move(info)), epoch(epoch), self(self) {}
    const std::string info; // conn info as loaded
    const uint64_t epoch;
    const bool self; // the local agent (the engine's self peer)
    std::mutex mutex;     // guards the fields below
    OrbitePeer peer{};    // open once connected; reopened after a loss
    std::chrono::steady_clock::time_point retry_after{}; // after a failed open
};

// Metadata of a peer's (or, through loadLocalMD, our own) registration.
// It names the range, not an engine registration: transfers resolve it
// against the peer's current description at prepXfer, so metadata NIXL
// keeps across a reload (same bytes) still reaches the current
// registration of that range.
class RemoteMD : public nixlBackendMD {
public:
    RemoteMD(std::shared_ptr<PeerSlot> slot, std::string agent, const OrbiteRemoteRange &range)
        : nixlBackendMD(false), slot(std::move(slot)), agent(std::move(agent)), range(range) {}
    std::shared_ptr<PeerSlot> slot;
    std::string agent;
    OrbiteRemoteRange range;
};

class Request : public nixlBackendReqH {
public:
    OrbiteXfer xfer{};
    uint32_t op = 0;
    OrbitePeer peer{};
    bool by_address = false; // remote descriptors name peer addresses
    std::vector<OrbiteDesc> local;
    std::vector<OrbiteDesc> remote;
    std::optional<std::string> notification; // payload as prepared (enveloped)
    XferDetail detail;
    // Set once a refused release was followed by retirement: the engine's
    // transfer is released; `final_status` is what checkXfer reports.
    bool xfer_released = false;
    nixl_status_t final_status = NIXL_ERR_NOT_POSTED;
    // The execution whose end was reported as a telemetry event (0: none).
    uint64_t telemetry_execution = 0;
};

// A notification's envelope: the sender's agent name travels with the
// payload (binary, lossless). Version 1: "ONF1", u16 LE name length, name,
// payload.
std::string wrapNotification(const std::string &agent, const std::string &payload);
bool unwrapNotification(const std::string &bytes, std::string &agent, std::string &payload);

// NIXL status of a transfer's state (the spec's table: IN_PROG until
// physical retirement, whatever the logical outcome).
nixl_status_t statusOf(const OrbiteXferState &s);
// NIXL status of a failed C ABI call.
nixl_status_t statusOf(OrbiteStatus s);
// The calling thread's last error message from the C ABI ("" if none).
std::string lastError();

// Sends the engine's log records to NIXL's logger, at NIXL_LOG_LEVEL's
// threshold (once per process; both backends call it before they create
// their engine).
void forwardLogsToNixl();

// Builds the engine's configuration from the backend's parameters: the
// explicit OrbiTE JSON ("config"), else the document in ORBITE_CONFIG (a
// JSON object or @file; read through the C ABI), with the progress worker
// taken from enableProgTh/pthrDelay. The engine is created as a deployment
// (ORBITE_ENGINE_DEPLOYMENT): without "listen" it listens on all
// interfaces. Returns false (and a reason) for any parameter it does not
// understand and for an unusable ORBITE_CONFIG.
bool buildConfig(const nixlBackendInitParams &params, std::string &json, std::string &error);

// True when liborbite_nixl takes VRAM registrations (ORBITE_FEATURE_VRAM:
// built with feature `cuda`, and the CUDA driver reports a device).
bool vramAvailable();
// The memory the ORBITE backend advertises: DRAM_SEG, and VRAM_SEG when
// vramAvailable().
nixl_mem_list_t supportedMems();

// Adds `"key": value` to a JSON object unless one of `unless` is among its
// top-level keys. False (with a reason) if `json` is not an object.
bool addDefault(std::string &json, const std::string &key, const std::string &value,
                const std::vector<std::string> &unless, std::string &error);

class Engine : public nixlBackendEngine {
public:
    explicit Engine(const nixlBackendInitParams *init_params);
    ~Engine() override;

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override;

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) override;
    nixl_status_t deregisterMem(nixlBackendMD *meta) override;

    nixl_status_t connect(const std::string &remote_agent) override;
    nixl_status_t disconnect(const std::string &remote_agent) override;
    nixl_status_t unloadMD(nixlBackendMD *input) override;

    nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const override;
    nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const override;
    nixl_status_t checkXfer(nixlBackendReqH *handle) const override;
    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override;

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override;
    nixl_status_t getConnInfo(std::string &str) const override;
    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent, const std::string &remote_conn_info) override;
    nixl_status_t loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &nixl_mem,
                               const std::string &remote_agent, nixlBackendMD *&output) override;
    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override;

    nixl_status_t getNotifs(notif_list_t &notif_list) override;
    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override;

    nixl_status_t queryMem(const nixl_reg_dlist_t &descs, std::vector<nixl_query_resp_t> &resp) const override;

    // Not part of NIXL's interface (yet): OrbiTE's explicit cancel. Queued
    // work never starts, started work drains; poll checkXfer until retired.
    nixl_status_t cancelXfer(nixlBackendReqH *handle) const;
    // The logical outcome and receipt of a request's last execution, which
    // NIXL's single status cannot carry.
    static const XferDetail &detailOf(const nixlBackendReqH *handle);
    // The engine, for tests (stats, fault hooks in test builds).
    OrbiteEngine orbiteEngine() const { return engine_; }
    // Why initialisation failed, if it did.
    const std::string &initError() const { return init_error_; }

private:
    // The slot of `agent` with its peer open (reopened if it was lost).
    nixl_status_t peerFor(const std::string &agent, std::shared_ptr<PeerSlot> &slot, OrbitePeer &out) const;
    // Closes a slot's peer without waiting: admitted work keeps the peer
    // until it retired.
    static void closeSlot(PeerSlot &slot);
    nixl_status_t prepare(Request &r) const;
    nixl_status_t fail(OrbiteStatus s, const char *what) const;
    // As fail(), logged at ERROR: a registration or preparation refused.
    nixl_status_t refuse(OrbiteStatus s, const char *what) const;
    // Releases the engine transfers of requests whose release was refused
    // while active, once they retired (NIXL may drop such a request
    // without asking again).
    void reap() const;
    // A request's execution ended with `status`: a failure is one telemetry
    // event (once per execution).
    void noteEnd(Request &r, nixl_status_t status) const;

    OrbiteEngine engine_{};
    nixl_mem_list_t mems_{DRAM_SEG};
    std::shared_ptr<PeerSlot> self_;
    std::string self_info_;
    std::string init_error_;
    mutable std::mutex mutex_; // guards peers_ (never held across a C ABI call that may block)
    mutable std::map<std::string, std::shared_ptr<PeerSlot>> peers_;
    mutable std::mutex pending_mutex_; // guards pending_
    mutable std::vector<Request *> pending_;
    mutable std::atomic<size_t> pending_count_{0};
};

} // namespace orbite_nixl

#endif
