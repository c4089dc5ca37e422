// SPDX-License-Identifier: Apache-2.0
// Direct calls of every method of the ORBITE backend, so that return codes
// NIXL's agent ignores cannot hide a failure. The adapter's sources are
// compiled into this program (their extra methods, such as cancelXfer, are
// not exported by the plugin); the built plugin is also loaded with dlopen
// to check its entry points.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend_plugin.h"
#include "nixl_descriptors.h"
#include "orbite_backend.h"

// NIXL defines these descriptor members out of line in its core library,
// which the plugin does not link; this test builds lists, so it brings its
// own definitions of the few it uses.
nixlBasicDesc::nixlBasicDesc(const uintptr_t &a, const size_t &l, const uint64_t &d) : addr(a), len(l), devId(d) {}
template <> nixlDescList<nixlMetaDesc>::nixlDescList(const nixl_mem_t &t, const int &n) : type(t), descs(n) {}
template <> void nixlDescList<nixlMetaDesc>::resize(const size_t &n) { descs.resize(n); }
template <> void nixlDescList<nixlMetaDesc>::addDesc(const nixlMetaDesc &d) { descs.push_back(d); }
template <> int nixlDescList<nixlMetaDesc>::getIndex(const nixlBasicDesc &) const { return -1; }
template <> nixlDescList<nixlBlobDesc>::nixlDescList(const nixl_mem_t &t, const int &n) : type(t), descs(n) {}
template <> void nixlDescList<nixlBlobDesc>::resize(const size_t &n) { descs.resize(n); }
template <> void nixlDescList<nixlBlobDesc>::addDesc(const nixlBlobDesc &d) { descs.push_back(d); }
template <> int nixlDescList<nixlBlobDesc>::getIndex(const nixlBasicDesc &) const { return -1; }

using orbite_nixl::Engine;

namespace {

int failures = 0;
int checks = 0;

#define CHECK(cond)                                                                                                 \
    do {                                                                                                            \
        ++checks;                                                                                                   \
        if (!(cond)) {                                                                                              \
            ++failures;                                                                                             \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                          \
        }                                                                                                           \
    } while (0)

struct Backend {
    std::unique_ptr<nixl_b_params_t> params;
    std::unique_ptr<nixlBackendInitParams> init;
    nixlBackendEngine *engine = nullptr;
    Engine *orbite() const { return dynamic_cast<Engine *>(engine); }
};

// What the backend must advertise, from the library's own feature bits:
// VRAM_SEG only where it takes VRAM registrations (a cuda build with a
// driver and a device; the NIXL tests run this without the CUDA shim).
bool libraryTakesVram() {
    auto info = orbite_nixl::record<OrbiteAbiInfo>();
    return orbite_abi_info(&info) == ORBITE_STATUS_OK && (info.features & ORBITE_FEATURE_VRAM) != 0;
}

nixl_mem_list_t expectedMems() {
    if (libraryTakesVram()) return {DRAM_SEG, VRAM_SEG};
    return {DRAM_SEG};
}

Backend make(const std::string &agent, const nixl_b_params_t &p, bool progress = false) {
    Backend b;
    b.params = std::make_unique<nixl_b_params_t>(p);
    b.init = std::make_unique<nixlBackendInitParams>();
    b.init->localAgent = agent;
    b.init->type = "ORBITE";
    b.init->customParams = b.params.get();
    b.init->enableProgTh = progress;
    b.init->pthrDelay = 0;
    b.init->enableTelemetry_ = true;
    b.engine = nixl_plugin_init()->create_engine(b.init.get());
    return b;
}

void destroy(Backend &b) {
    nixl_plugin_init()->destroy_engine(b.engine);
    b.engine = nullptr;
}

OrbiteStats stats(const Backend &b) {
    OrbiteStats s{};
    s.size = sizeof s;
    s.version = ORBITE_RECORD_VERSION;
    CHECK(orbite_engine_stats(b.orbite()->orbiteEngine(), &s) == ORBITE_STATUS_OK);
    return s;
}

bool same(const OrbiteStats &a, const OrbiteStats &b) { return std::memcmp(&a, &b, sizeof a) == 0; }

nixl_status_t poll(nixlBackendEngine *e, nixlBackendReqH *h) {
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    nixl_status_t s;
    while ((s = e->checkXfer(h)) == NIXL_IN_PROG && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return s;
}

nixl_meta_dlist_t list(std::initializer_list<nixlMetaDesc> d) {
    nixl_meta_dlist_t l(DRAM_SEG);
    for (const auto &x : d) l.addDesc(x);
    return l;
}

void plugin_entry_points(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != nullptr);
    if (lib == nullptr) {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return;
    }
    auto init = reinterpret_cast<nixlBackendPlugin *(*)()>(dlsym(lib, "nixl_plugin_init"));
    auto fini = reinterpret_cast<void (*)()>(dlsym(lib, "nixl_plugin_fini"));
    CHECK(init != nullptr && fini != nullptr);
    if (init != nullptr) {
        nixlBackendPlugin *p = init();
        CHECK(p->api_version == NIXL_PLUGIN_API_VERSION);
        CHECK(std::string(p->get_plugin_name()) == "ORBITE");
        CHECK(p->get_backend_mems() == expectedMems());
        CHECK(p->get_backend_options().count("config") == 1);
        // Creation failure is reported through the init error, never an
        // exception or a crash.
        nixl_b_params_t bad{{"no_such_param", "1"}};
        nixlBackendInitParams ip;
        ip.localAgent = "x";
        ip.type = "ORBITE";
        ip.customParams = &bad;
        nixlBackendEngine *e = p->create_engine(&ip);
        CHECK(e != nullptr && e->getInitErr());
        p->destroy_engine(e);
        nixl_b_params_t badjson{{"config", "{\"no_such_field\": 1}"}};
        ip.customParams = &badjson;
        e = p->create_engine(&ip);
        CHECK(e != nullptr && e->getInitErr());
        p->destroy_engine(e);
        fini();
    }
    dlclose(lib);
}

void capabilities_and_unsupported_memory() {
    Backend b = make("caps", {});
    CHECK(!b.engine->getInitErr());
    CHECK(b.engine->supportsRemote() && b.engine->supportsLocal() && b.engine->supportsNotif());
    CHECK(b.engine->getSupportedMems() == expectedMems());
    std::vector<uint8_t> buf(4096);
    nixlBlobDesc d;
    d.addr = reinterpret_cast<uintptr_t>(buf.data());
    d.len = buf.size();
    d.devId = 0;
    OrbiteStats base = stats(b);
    for (nixl_mem_t m : {VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG}) {
        nixlBackendMD *md = nullptr;
        nixl_status_t st = b.engine->registerMem(d, m, md);
        // Host memory named as VRAM: the driver does not vouch for it.
        if (m == VRAM_SEG && libraryTakesVram()) {
            CHECK(st == NIXL_ERR_INVALID_PARAM);
        } else {
            CHECK(st == NIXL_ERR_NOT_SUPPORTED);
        }
        CHECK(md == nullptr);
    }
    CHECK(same(stats(b), base));
    nixl_reg_dlist_t q(DRAM_SEG);
    std::vector<nixl_query_resp_t> resp;
    CHECK(b.engine->queryMem(q, resp) == NIXL_ERR_NOT_SUPPORTED);
    nixl_meta_dlist_t empty(DRAM_SEG);
    std::chrono::microseconds dur{}, margin{};
    nixl_cost_t method{};
    nixlBackendReqH *none = nullptr;
    CHECK(b.engine->estimateXferCost(NIXL_WRITE, empty, empty, "caps", none, dur, margin, method) ==
          NIXL_ERR_NOT_SUPPORTED);
    nixlMemViewH view = nullptr;
    CHECK(b.engine->prepMemView(empty, view) == NIXL_ERR_NOT_SUPPORTED);
    std::string info;
    CHECK(b.engine->getConnInfo(info) == NIXL_SUCCESS && !info.empty());
    CHECK(b.engine->loadRemoteConnInfo("junk", "not conn info") == NIXL_ERR_INVALID_PARAM);
    CHECK(b.engine->connect("nobody") == NIXL_ERR_NOT_FOUND);
    destroy(b);
}

struct Local {
    Backend b;
    std::vector<uint8_t> src, dst;
    nixlBackendMD *src_md = nullptr, *dst_md = nullptr, *dst_remote = nullptr;
};

void setup_local(Local &l, const std::string &agent, const nixl_b_params_t &p, size_t n) {
    l.b = make(agent, p);
    CHECK(!l.b.engine->getInitErr());
    l.src.resize(n);
    l.dst.assign(n, 0xEE);
    for (size_t i = 0; i < n; ++i) l.src[i] = static_cast<uint8_t>(i * 13 + 1);
    nixlBlobDesc s, d;
    s.addr = reinterpret_cast<uintptr_t>(l.src.data());
    s.len = n;
    d.addr = reinterpret_cast<uintptr_t>(l.dst.data());
    d.len = n;
    CHECK(l.b.engine->registerMem(s, DRAM_SEG, l.src_md) == NIXL_SUCCESS);
    CHECK(l.b.engine->registerMem(d, DRAM_SEG, l.dst_md) == NIXL_SUCCESS);
    CHECK(l.b.engine->connect(agent) == NIXL_SUCCESS);
    CHECK(l.b.engine->loadLocalMD(l.dst_md, l.dst_remote) == NIXL_SUCCESS);
}

void teardown_local(Local &l) {
    CHECK(l.b.engine->unloadMD(l.dst_remote) == NIXL_SUCCESS);
    CHECK(l.b.engine->deregisterMem(l.src_md) == NIXL_SUCCESS);
    CHECK(l.b.engine->deregisterMem(l.dst_md) == NIXL_SUCCESS);
    OrbiteStats s = stats(l.b);
    CHECK(s.registrations == 0 && s.prepared_transfers == 0 && s.executions == 0 && s.fenced_registrations == 0);
    destroy(l.b);
}

nixlMetaDesc at(const std::vector<uint8_t> &v, size_t off, size_t len, nixlBackendMD *md) {
    return nixlMetaDesc(reinterpret_cast<uintptr_t>(v.data()) + off, len, 0, md);
}

void local_transfer_repost_and_notification() {
    Local l;
    setup_local(l, "loc", {}, 1 << 20);
    auto local = list({at(l.src, 1, 1000, l.src_md), at(l.src, 70000, 300000, l.src_md)});
    auto remote = list({at(l.dst, 5, 200000, l.dst_remote), at(l.dst, 400000, 101000, l.dst_remote)});
    nixl_opt_b_args_t args;
    args.hasNotif = true;
    args.notifMsg = std::string("done\0\xff", 6);
    nixlBackendReqH *h = nullptr;
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, local, remote, "loc", h, &args) == NIXL_SUCCESS);
    CHECK(l.b.engine->checkXfer(h) == NIXL_ERR_NOT_POSTED);
    for (int round = 0; round < 3; ++round) {
        l.src[1] = static_cast<uint8_t>(round);
        nixl_status_t s = l.b.engine->postXfer(NIXL_WRITE, local, remote, "loc", h, &args);
        CHECK(s == NIXL_IN_PROG || s == NIXL_SUCCESS);
        CHECK(poll(l.b.engine, h) == NIXL_SUCCESS);
        CHECK(l.dst[5] == static_cast<uint8_t>(round));
        CHECK(Engine::detailOf(h).execution == static_cast<uint64_t>(round + 1));
    }
    std::vector<uint8_t> sent(l.src.begin() + 1, l.src.begin() + 1001);
    sent.insert(sent.end(), l.src.begin() + 70000, l.src.begin() + 370000);
    CHECK(std::memcmp(l.dst.data() + 5, sent.data(), 200000) == 0);
    CHECK(std::memcmp(l.dst.data() + 400000, sent.data() + 200000, 101000) == 0);
    CHECK(l.dst[4] == 0xEE && l.dst[200005] == 0xEE && l.dst[399999] == 0xEE && l.dst[501000] == 0xEE);
    notif_list_t n;
    CHECK(l.b.engine->getNotifs(n) == NIXL_SUCCESS);
    CHECK(n.size() == 3);
    for (const auto &[agent, msg] : n) CHECK(agent == "loc" && msg == args.notifMsg);
    CHECK(l.b.engine->genNotif("loc", std::string("\0x", 2)) == NIXL_SUCCESS);
    n.clear();
    CHECK(l.b.engine->getNotifs(n) == NIXL_SUCCESS && n.size() == 1 && n[0].second == std::string("\0x", 2));
    CHECK(l.b.engine->releaseReqH(h) == NIXL_SUCCESS);
    // customParam data the backend does not understand is refused.
    nixl_opt_b_args_t custom;
    custom.customParam = "priority=high";
    nixlBackendReqH *h2 = nullptr;
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, local, remote, "loc", h2, &custom) == NIXL_ERR_INVALID_PARAM);
    teardown_local(l);
}

void active_release_failure_and_no_repost() {
    Local l;
    setup_local(l, "hold", {{"config", "{\"local_route_workers\": 1}"}}, 8192);
    OrbiteEngine oe = l.b.orbite()->orbiteEngine();
    auto local = list({at(l.src, 0, 8192, l.src_md)});
    auto remote = list({at(l.dst, 0, 8192, l.dst_remote)});
    nixlBackendReqH *h = nullptr;
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, local, remote, "hold", h) == NIXL_SUCCESS);
    CHECK(orbite_test_hold_all(oe, 1) == ORBITE_STATUS_OK);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "hold", h) == NIXL_IN_PROG);
    uint64_t held = 0;
    CHECK(orbite_test_wait_held(oe, 1, 10000, &held) == ORBITE_STATUS_OK && held == 1);
    // Release of active work: negative, the handle stays pollable.
    nixl_status_t r = l.b.engine->releaseReqH(h);
    CHECK(r < 0);
    CHECK(l.b.engine->checkXfer(h) == NIXL_IN_PROG);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "hold", h) == NIXL_ERR_REPOST_ACTIVE);
    // Deregistering the source fences it but it stays alive under the task.
    nixlBackendMD *src_md = l.src_md;
    CHECK(l.b.engine->deregisterMem(src_md) == NIXL_SUCCESS);
    l.src_md = nullptr;
    CHECK(stats(l.b).fenced_registrations == 1);
    // A failure with unknown effect: IN_PROG until retirement, then an
    // error carrying the prefix and the effect; never reposted.
    CHECK(orbite_test_hold_all(oe, 0) == ORBITE_STATUS_OK);
    CHECK(orbite_test_release_held(oe, ORBITE_TEST_FAIL, 100, 1) == ORBITE_STATUS_OK);
    CHECK(poll(l.b.engine, h) == NIXL_ERR_BACKEND);
    CHECK(l.b.engine->checkXfer(h) == NIXL_ERR_BACKEND); // asked again: one event still
    // The failed execution, as one backend telemetry event.
    auto events = l.b.engine->getTelemetryEvents();
    CHECK(events.size() == 1 && events[0].eventType_ == nixl_telemetry_event_type_t::AGENT_ERR_BACKEND &&
          events[0].value_ == 1);
    const auto &d = Engine::detailOf(h);
    CHECK(d.drained == 1 && d.code == ORBITE_OUTCOME_FAILED && d.remote_effect == ORBITE_EFFECT_UNKNOWN &&
          d.transferred_prefix == 100);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "hold", h) == NIXL_ERR_NOT_ALLOWED);
    CHECK(l.b.engine->releaseReqH(h) == NIXL_SUCCESS);
    CHECK(stats(l.b).fenced_registrations == 0);
    // Reuse the teardown with a fresh source registration.
    nixlBlobDesc s;
    s.addr = reinterpret_cast<uintptr_t>(l.src.data());
    s.len = l.src.size();
    CHECK(l.b.engine->registerMem(s, DRAM_SEG, l.src_md) == NIXL_SUCCESS);
    teardown_local(l);
}

// NIXL 1.5 deletes its request when a release it saw refused is asked for
// again, without another successful releaseReqH: the backend must still
// give the engine's transfer back once it retired, and free the request at
// the latest when it is destroyed (ASan's leak check covers that here).
void release_refused_then_dropped() {
    Local l;
    setup_local(l, "drop", {{"config", "{\"local_route_workers\": 1}"}}, 8192);
    OrbiteEngine oe = l.b.orbite()->orbiteEngine();
    auto local = list({at(l.src, 0, 4096, l.src_md)});
    auto remote = list({at(l.dst, 0, 4096, l.dst_remote)});
    nixlBackendReqH *kept = nullptr, *dropped = nullptr;
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, local, remote, "drop", kept) == NIXL_SUCCESS);
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, local, remote, "drop", dropped) == NIXL_SUCCESS);
    CHECK(orbite_test_hold_all(oe, 1) == ORBITE_STATUS_OK);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "drop", kept) == NIXL_IN_PROG);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "drop", dropped) == NIXL_IN_PROG);
    uint64_t held = 0;
    CHECK(orbite_test_wait_held(oe, 2, 10000, &held) == ORBITE_STATUS_OK && held == 2);
    CHECK(l.b.engine->releaseReqH(kept) == NIXL_ERR_REPOST_ACTIVE);
    CHECK(l.b.engine->releaseReqH(dropped) == NIXL_ERR_REPOST_ACTIVE);
    CHECK(l.b.engine->releaseReqH(dropped) == NIXL_ERR_REPOST_ACTIVE); // then NIXL forgets it
    CHECK(stats(l.b).prepared_transfers == 2);
    CHECK(orbite_test_hold_all(oe, 0) == ORBITE_STATUS_OK);
    CHECK(orbite_test_release_held(oe, ORBITE_TEST_RUN, 0, 0) == ORBITE_STATUS_OK);
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    notif_list_t n;
    while (stats(l.b).prepared_transfers != 0 && std::chrono::steady_clock::now() < end) {
        CHECK(l.b.engine->getNotifs(n) == NIXL_SUCCESS); // any call reaps
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    CHECK(stats(l.b).prepared_transfers == 0);
    // The kept request still answers, with its final status, and releases.
    CHECK(l.b.engine->checkXfer(kept) == NIXL_SUCCESS);
    CHECK(Engine::detailOf(kept).drained == 1);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, local, remote, "drop", kept) == NIXL_ERR_NOT_ALLOWED);
    CHECK(l.b.engine->releaseReqH(kept) == NIXL_SUCCESS);
    teardown_local(l); // frees `dropped`
}

void explicit_cancel_of_queued_work() {
    Local l;
    setup_local(l, "cancel", {{"config", "{\"local_route_workers\": 1, \"max_tasks_in_flight\": 1}"}}, 1 << 16);
    OrbiteEngine oe = l.b.orbite()->orbiteEngine();
    auto la = list({at(l.src, 0, 4096, l.src_md)});
    auto ra = list({at(l.dst, 0, 4096, l.dst_remote)});
    auto lb = list({at(l.src, 8192, 4096, l.src_md)});
    auto rb = list({at(l.dst, 8192, 4096, l.dst_remote)});
    nixlBackendReqH *a = nullptr, *b = nullptr;
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, la, ra, "cancel", a) == NIXL_SUCCESS);
    CHECK(l.b.engine->prepXfer(NIXL_WRITE, lb, rb, "cancel", b) == NIXL_SUCCESS);
    CHECK(orbite_test_hold_all(oe, 1) == ORBITE_STATUS_OK);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, la, ra, "cancel", a) == NIXL_IN_PROG);
    uint64_t held = 0;
    CHECK(orbite_test_wait_held(oe, 1, 10000, &held) == ORBITE_STATUS_OK && held == 1);
    CHECK(l.b.engine->postXfer(NIXL_WRITE, lb, rb, "cancel", b) == NIXL_IN_PROG); // queued: budget of one task
    CHECK(l.b.orbite()->cancelXfer(b) == NIXL_SUCCESS);
    CHECK(poll(l.b.engine, b) == NIXL_ERR_CANCELED);
    CHECK(Engine::detailOf(b).drained == 1 && Engine::detailOf(b).transferred_bytes == 0);
    CHECK(l.dst[8192] == 0xEE); // nothing of the cancelled transfer landed
    CHECK(l.b.engine->postXfer(NIXL_WRITE, lb, rb, "cancel", b) == NIXL_ERR_NOT_ALLOWED);
    CHECK(orbite_test_hold_all(oe, 0) == ORBITE_STATUS_OK);
    CHECK(orbite_test_release_held(oe, ORBITE_TEST_RUN, 0, 0) == ORBITE_STATUS_OK);
    CHECK(poll(l.b.engine, a) == NIXL_SUCCESS);
    CHECK(l.b.engine->releaseReqH(a) == NIXL_SUCCESS);
    CHECK(l.b.engine->releaseReqH(b) == NIXL_SUCCESS);
    teardown_local(l);
}

void two_engines_remote_write_and_notification() {
    Backend a = make("A", {}, true), b = make("B", {});
    CHECK(!a.engine->getInitErr() && !b.engine->getInitErr());
    std::vector<uint8_t> mine(1 << 20), theirs(1 << 20, 0x55);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<uint8_t>(i % 241);
    nixlBlobDesc md, td;
    md.addr = reinterpret_cast<uintptr_t>(mine.data());
    md.len = mine.size();
    td.addr = reinterpret_cast<uintptr_t>(theirs.data());
    td.len = theirs.size();
    nixlBackendMD *mmd = nullptr, *tmd = nullptr, *tremote = nullptr;
    CHECK(a.engine->registerMem(md, DRAM_SEG, mmd) == NIXL_SUCCESS);
    CHECK(b.engine->registerMem(td, DRAM_SEG, tmd) == NIXL_SUCCESS);
    std::string info_b, info_a, pub;
    CHECK(b.engine->getConnInfo(info_b) == NIXL_SUCCESS && a.engine->getConnInfo(info_a) == NIXL_SUCCESS);
    CHECK(a.engine->loadRemoteConnInfo("B", info_b) == NIXL_SUCCESS);
    CHECK(b.engine->loadRemoteConnInfo("A", info_a) == NIXL_SUCCESS);
    CHECK(a.engine->connect("B") == NIXL_SUCCESS);
    CHECK(b.engine->getPublicData(tmd, pub) == NIXL_SUCCESS);
    nixlBlobDesc remote_blob;
    remote_blob.addr = td.addr;
    remote_blob.len = td.len;
    remote_blob.metaInfo = pub;
    CHECK(a.engine->loadRemoteMD(remote_blob, DRAM_SEG, "B", tremote) == NIXL_SUCCESS);
    nixlBackendMD *wrong = nullptr;
    CHECK(a.engine->loadRemoteMD(remote_blob, FILE_SEG, "B", wrong) == NIXL_ERR_NOT_SUPPORTED);
    auto local = list({at(mine, 3, 600000, mmd)});
    auto remote = list({at(theirs, 11, 600000, tremote)});
    nixl_opt_b_args_t args;
    args.hasNotif = true;
    args.notifMsg = "block 7 ready";
    nixlBackendReqH *h = nullptr;
    CHECK(a.engine->prepXfer(NIXL_WRITE, local, remote, "B", h, &args) == NIXL_SUCCESS);
    nixl_status_t s = a.engine->postXfer(NIXL_WRITE, local, remote, "B", h, &args);
    CHECK(s == NIXL_IN_PROG || s == NIXL_SUCCESS);
    CHECK(poll(a.engine, h) == NIXL_SUCCESS);
    CHECK(std::memcmp(theirs.data() + 11, mine.data() + 3, 600000) == 0);
    CHECK(theirs[10] == 0x55 && theirs[600011] == 0x55);
    notif_list_t n;
    for (int i = 0; i < 2000 && n.empty(); ++i) {
        CHECK(b.engine->getNotifs(n) == NIXL_SUCCESS);
        if (n.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(n.size() == 1 && n[0].first == "A" && n[0].second == "block 7 ready");
    CHECK(a.engine->releaseReqH(h) == NIXL_SUCCESS);
    CHECK(a.engine->unloadMD(tremote) == NIXL_SUCCESS);
    CHECK(a.engine->disconnect("B") == NIXL_SUCCESS);
    CHECK(a.engine->disconnect("B") == NIXL_ERR_NOT_FOUND);
    CHECK(a.engine->deregisterMem(mmd) == NIXL_SUCCESS);
    CHECK(b.engine->deregisterMem(tmd) == NIXL_SUCCESS);
    destroy(a);
    destroy(b);
}

} // namespace

int main(int argc, char **argv) {
    if (argc > 1) plugin_entry_points(argv[1]);
    capabilities_and_unsupported_memory();
    local_transfer_repost_and_notification();
    active_release_failure_and_no_repost();
    explicit_cancel_of_queued_work();
    release_refused_then_dropped();
    two_engines_remote_write_and_notification();
    std::printf("direct backend test: %d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
