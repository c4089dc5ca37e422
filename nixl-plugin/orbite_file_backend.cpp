// SPDX-License-Identifier: Apache-2.0
#include "orbite_file_backend.h"

#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>

#include "common/nixl_log.h"
#include "orbite_backend.h"

namespace orbite_nixl {

namespace {

constexpr uint64_t kCloseTimeoutMs = 5000;

// A registered DRAM range.
class MemMD : public nixlBackendMD {
public:
    MemMD(OrbiteRegistration reg, uint64_t addr) : nixlBackendMD(true), reg(reg), addr(addr) {}
    OrbiteRegistration reg;
    uint64_t addr;
};

// A registered file: NIXL's descriptor names it by fd; OrbiTE owns a checked
// duplicate, so the caller's fd number may be closed and reused.
class FileMD : public nixlBackendMD {
public:
    FileMD(OrbiteFile file, int fd) : nixlBackendMD(true), file(file), fd(fd) {}
    OrbiteFile file;
    int fd; // the caller's number at registration, for queryMem
};

// loadLocalMD's wrapper: unloading it never deregisters the source.
class LocalRef : public nixlBackendMD {
public:
    explicit LocalRef(nixlBackendMD *target) : nixlBackendMD(false), target(target) {}
    nixlBackendMD *target;
};

// Every registration or preparation refused says why through NIXL's
// logger, with the engine's reason where the engine refused.
nixl_status_t refused(nixl_status_t status, const char *what, const std::string &why) {
    NIXL_ERROR << "ORBITE_FILE: " << what << " refused: " << why;
    return status;
}

// The parts, streamed into one string.
template <class... Parts> std::string said(const Parts &...parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

nixl_status_t refusedBy(OrbiteStatus s, const char *what) { return refused(statusOf(s), what, lastError()); }

nixlBackendMD *resolve(nixlBackendMD *md) {
    auto *ref = dynamic_cast<LocalRef *>(md);
    return ref != nullptr ? ref->target : md;
}

// One request: one OrbiTE transfer per file it names, in first-use order.
class FileRequest : public nixlBackendReqH {
public:
    std::vector<OrbiteXfer> xfers;
    std::vector<OrbiteFile> files; // one per transfer
    // A post failed after part of the request had started: the started
    // parts were cancelled; the request ends in an error once they retire.
    bool post_failed = false;
    // A release was refused while active; the transfers are released once
    // retired (NIXL may drop the request without asking again).
    bool release_pending = false;
    bool released = false;
    nixl_status_t final_status = NIXL_ERR_NOT_POSTED;
};


} // namespace
// Requests whose release was refused, per backend.
struct Pending {
    std::mutex mutex;
    std::vector<FileRequest *> requests;
};

// The files registered, by the caller's descriptor number at registration
// (queryMem answers a descriptor from the engine's own duplicate).
struct Files {
    std::mutex mutex;
    std::multimap<int, OrbiteFile> by_fd;
};

FileEngine::FileEngine(const nixlBackendInitParams *init_params)
    : nixlBackendEngine(init_params), pending_(std::make_shared<Pending>()), files_(std::make_shared<Files>()) {
    try {
        forwardLogsToNixl();
        std::string json = "{}";
        if (init_params->customParams != nullptr) {
            for (const auto &[key, value] : *init_params->customParams) {
                if (key != "config") {
                    NIXL_ERROR << "ORBITE_FILE: unknown backend parameter '" << key << "'";
                    initErr = true;
                    return;
                }
                json = value;
            }
        }
        // Files move in 8 MiB tasks unless the configuration says otherwise:
        // one vectored operation per task, so fewer and larger system calls
        // (measured with scripts/nixl-file-bench).
        std::string error;
        if (!addDefault(json, "task_bytes", "8388608", {"max_bytes_in_flight"}, error)) {
            NIXL_ERROR << "ORBITE_FILE: " << error;
            initErr = true;
            return;
        }
        auto options = record<OrbiteEngineOptions>();
        options.abi_major = ORBITE_ABI_MAJOR;
        options.required_features = ORBITE_FEATURE_FILES;
        options.config_json = reinterpret_cast<const uint8_t *>(json.data());
        options.config_json_len = json.size();
        if (orbite_engine_create(&options, &engine_) != ORBITE_STATUS_OK) {
            NIXL_ERROR << "ORBITE_FILE: engine creation failed";
            initErr = true;
        }
    } catch (...) {
        initErr = true;
    }
}

FileEngine::~FileEngine() {
    if (engine_.raw == 0) return;
    auto report = record<OrbiteCloseReport>();
    orbite_engine_close(engine_, kCloseTimeoutMs, &report);
    reap();
    for (auto *r : pending_->requests) {
        if (r->released) delete r; // NIXL calls nothing after destroying the backend
    }
    pending_->requests.clear();
    if (orbite_engine_release(engine_) != ORBITE_STATUS_OK) {
        NIXL_ERROR << "ORBITE_FILE: engine kept alive at destruction (handles still alive)";
    }
}

nixl_mem_list_t FileEngine::getSupportedMems() const {
    if (vramAvailable()) return {DRAM_SEG, VRAM_SEG, FILE_SEG};
    return {DRAM_SEG, FILE_SEG};
}

nixl_status_t FileEngine::registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) {
    if (nixl_mem == DRAM_SEG || nixl_mem == VRAM_SEG) {
        const char *what = nixl_mem == DRAM_SEG ? "registerMem (DRAM)" : "registerMem (VRAM)";
        auto region = record<OrbiteMemRegion>();
        region.addr = mem.addr;
        region.len = mem.len;
        region.kind = ORBITE_MEM_DRAM;
        region.permission = ORBITE_PERM_LOCAL_ONLY;
        if (nixl_mem == VRAM_SEG) {
            // NIXL's device id of VRAM is the CUDA ordinal; the engine checks
            // the range with the driver, or says why it takes no VRAM.
            if (mem.devId > UINT32_MAX)
                return refused(NIXL_ERR_INVALID_PARAM, what, said("device ", mem.devId, " is no CUDA ordinal"));
            region.kind = ORBITE_MEM_VRAM;
            region.device = static_cast<uint32_t>(mem.devId);
        }
        OrbiteRegistration reg{};
        OrbiteStatus s = orbite_mem_register(engine_, &region, &reg);
        if (s != ORBITE_STATUS_OK) return refusedBy(s, what);
        out = new (std::nothrow) MemMD(reg, mem.addr);
        if (out == nullptr) {
            orbite_mem_deregister(reg);
            return refused(NIXL_ERR_BACKEND, what, "out of memory");
        }
        return NIXL_SUCCESS;
    }
    if (nixl_mem != FILE_SEG)
        return refused(NIXL_ERR_NOT_SUPPORTED, "registerMem", "only DRAM, VRAM and FILE registrations are taken");
    if (mem.devId > static_cast<uint64_t>(INT32_MAX))
        return refused(NIXL_ERR_INVALID_PARAM, "registerMem (FILE)", said("devId ", mem.devId, " is not a file descriptor"));
    int fd = static_cast<int>(mem.devId);
    OrbiteFile file{};
    OrbiteStatus s = orbite_file_adopt(engine_, fd, ORBITE_FILE_READ_WRITE, &file);
    if (s == ORBITE_STATUS_NOT_ALLOWED) s = orbite_file_adopt(engine_, fd, ORBITE_FILE_READ_ONLY, &file);
    if (s != ORBITE_STATUS_OK) return refusedBy(s, "registerMem (FILE)");
    out = new (std::nothrow) FileMD(file, fd);
    if (out == nullptr) {
        orbite_file_close(file, kCloseTimeoutMs);
        return refused(NIXL_ERR_BACKEND, "registerMem (FILE)", "out of memory");
    }
    {
        std::lock_guard<std::mutex> lock(files_->mutex);
        files_->by_fd.emplace(fd, file);
    }
    return NIXL_SUCCESS;
}

nixl_status_t FileEngine::deregisterMem(nixlBackendMD *meta) {
    if (auto *m = dynamic_cast<MemMD *>(meta)) {
        OrbiteStatus s = orbite_mem_deregister(m->reg);
        delete m;
        return statusOf(s);
    }
    if (auto *f = dynamic_cast<FileMD *>(meta)) {
        {
            std::lock_guard<std::mutex> lock(files_->mutex);
            auto range = files_->by_fd.equal_range(f->fd);
            for (auto it = range.first; it != range.second; ++it) {
                if (it->second.raw == f->file.raw) {
                    files_->by_fd.erase(it);
                    break;
                }
            }
        }
        // Fences new transfers and waits for admitted I/O.
        OrbiteStatus s = orbite_file_close(f->file, kCloseTimeoutMs);
        delete f;
        return statusOf(s);
    }
    return NIXL_ERR_INVALID_PARAM;
}

nixl_status_t FileEngine::connect(const std::string &remote_agent) {
    return remote_agent == localAgent ? NIXL_SUCCESS : NIXL_ERR_NOT_SUPPORTED;
}

nixl_status_t FileEngine::disconnect(const std::string &remote_agent) {
    return remote_agent == localAgent ? NIXL_SUCCESS : NIXL_ERR_NOT_SUPPORTED;
}

nixl_status_t FileEngine::loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) {
    nixlBackendMD *target = resolve(input);
    if (dynamic_cast<MemMD *>(target) == nullptr && dynamic_cast<FileMD *>(target) == nullptr) {
        return NIXL_ERR_INVALID_PARAM;
    }
    output = new (std::nothrow) LocalRef(target);
    return output == nullptr ? NIXL_ERR_BACKEND : NIXL_SUCCESS;
}

nixl_status_t FileEngine::unloadMD(nixlBackendMD *input) {
    auto *ref = dynamic_cast<LocalRef *>(input);
    if (ref == nullptr) return NIXL_ERR_INVALID_PARAM;
    delete ref;
    return NIXL_SUCCESS;
}

nixl_status_t FileEngine::prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args) const {
    // Everything is checked before any I/O.
    const char *what = "prepXfer";
    if (remote_agent != localAgent)
        return refused(NIXL_ERR_NOT_SUPPORTED, what, said("files are local: remote agent '", remote_agent, "'"));
    if (opt_args != nullptr && opt_args->hasNotif)
        return refused(NIXL_ERR_NOT_SUPPORTED, what, "a notification to a local file");
    if (opt_args != nullptr && !opt_args->customParam.empty())
        return refused(NIXL_ERR_INVALID_PARAM, what, "custom parameters are not taken");
    bool file_local = local.getType() == FILE_SEG, file_remote = remote.getType() == FILE_SEG;
    if (file_local == file_remote)
        return refused(NIXL_ERR_NOT_SUPPORTED, what, "exactly one side must be FILE");
    const nixl_meta_dlist_t &mems = file_local ? remote : local;
    const nixl_meta_dlist_t &files = file_local ? local : remote;
    if (mems.getType() != DRAM_SEG && mems.getType() != VRAM_SEG)
        return refused(NIXL_ERR_NOT_SUPPORTED, what, "the memory side must be DRAM or VRAM");
    if (mems.descCount() != files.descCount())
        return refused(NIXL_ERR_INVALID_PARAM, what,
                       said(mems.descCount(), " memory descriptors against ", files.descCount(), " file descriptors"));
    // NIXL READ moves remote bytes into the local list, WRITE the reverse;
    // with the file on the local list the memory-side operation flips.
    bool file_to_memory = (operation == NIXL_READ) == file_remote;
    uint32_t op = file_to_memory ? ORBITE_OP_READ : ORBITE_OP_WRITE;
    struct Group {
        OrbiteFile file;
        std::vector<OrbiteDesc> mem, ext;
    };
    std::vector<Group> groups;
    for (int i = 0; i < mems.descCount(); ++i) {
        const auto &m = mems[i];
        const auto &f = files[i];
        if (m.len != f.len)
            return refused(NIXL_ERR_INVALID_PARAM, what,
                           said("descriptor ", i, ": ", m.len, " bytes of memory against ", f.len, " of file"));
        auto *mmd = dynamic_cast<MemMD *>(resolve(m.metadataP));
        auto *fmd = dynamic_cast<FileMD *>(resolve(f.metadataP));
        if (mmd == nullptr || fmd == nullptr || m.addr < mmd->addr)
            return refused(NIXL_ERR_INVALID_PARAM, what, said("descriptor ", i, " is not a registration of this backend"));
        auto g = std::find_if(groups.begin(), groups.end(), [&](const Group &x) { return x.file.raw == fmd->file.raw; });
        if (g == groups.end()) g = groups.insert(groups.end(), Group{fmd->file, {}, {}});
        g->mem.push_back(OrbiteDesc{mmd->reg.raw, m.addr - mmd->addr, m.len});
        g->ext.push_back(OrbiteDesc{0, f.addr, f.len});
    }
    auto r = std::make_unique<FileRequest>();
    for (const auto &g : groups) {
        auto spec = record<OrbiteXferSpec>();
        spec.op = op;
        spec.local = g.mem.data();
        spec.local_count = g.mem.size();
        spec.remote = g.ext.data();
        spec.remote_count = g.ext.size();
        OrbiteXfer x{};
        OrbiteStatus s = orbite_xfer_prepare_file(engine_, &spec, g.file, &x);
        if (s != ORBITE_STATUS_OK) {
            nixl_status_t status = refusedBy(s, what);
            for (auto done : r->xfers) orbite_xfer_release(done);
            return status;
        }
        r->xfers.push_back(x);
        r->files.push_back(g.file);
    }
    handle = r.release();
    return NIXL_SUCCESS;
}

nixl_status_t FileEngine::postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
                                   const std::string &, nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args) const {
    auto *r = dynamic_cast<FileRequest *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    if (opt_args != nullptr && opt_args->hasNotif) return NIXL_ERR_NOT_SUPPORTED;
    if (r->released || r->release_pending || r->post_failed) return NIXL_ERR_NOT_ALLOWED;
    // Refuse before posting any part that cannot go: an active or failed
    // part, or a file that was closed (deregistered).
    for (size_t i = 0; i < r->xfers.size(); ++i) {
        auto st = record<OrbiteXferState>();
        if (orbite_xfer_query(r->xfers[i], &st) != ORBITE_STATUS_OK) return NIXL_ERR_BACKEND;
        if (st.state == ORBITE_STATE_IN_PROGRESS) return NIXL_ERR_REPOST_ACTIVE;
        if (st.state == ORBITE_STATE_RETIRED && st.code != ORBITE_OUTCOME_SUCCESS) return NIXL_ERR_NOT_ALLOWED;
        auto info = record<OrbiteFileInfo>();
        OrbiteStatus q = orbite_file_query(r->files[i], &info);
        if (q != ORBITE_STATUS_OK || info.closed != 0) return NIXL_ERR_NOT_FOUND;
    }
    for (size_t i = 0; i < r->xfers.size(); ++i) {
        OrbiteStatus s = orbite_xfer_post(r->xfers[i]);
        if (s == ORBITE_STATUS_OK) continue;
        if (i == 0) return statusOf(s); // nothing started
        // Part of the request started (a budget filled up meanwhile, say):
        // stop it, and report the error only once it retired.
        for (size_t j = 0; j < i; ++j) orbite_xfer_cancel(r->xfers[j]);
        r->post_failed = true;
        NIXL_WARN << "ORBITE_FILE: part of a request could not be posted; the rest was cancelled";
        break;
    }
    return checkXfer(handle);
}

nixl_status_t FileEngine::checkXfer(nixlBackendReqH *handle) const {
    auto *r = dynamic_cast<FileRequest *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    reap();
    if (r->released) return r->final_status;
    nixl_status_t worst = NIXL_SUCCESS;
    for (auto x : r->xfers) {
        auto st = record<OrbiteXferState>();
        OrbiteStatus s = orbite_xfer_query(x, &st);
        if (s != ORBITE_STATUS_OK) return statusOf(s);
        nixl_status_t one = statusOf(st);
        if (one == NIXL_IN_PROG) {
            // Terminal only once every part retired. The caller will ask
            // again, often at once (NIXL's Python agent polls in a tight
            // loop): give the processor to the threads doing the work (the
            // engine's workers, io_uring's) first. Without a runnable
            // thread waiting on this CPU it returns at once.
            sched_yield();
            return NIXL_IN_PROG;
        }
        if (r->post_failed && one == NIXL_ERR_NOT_POSTED) continue; // the part that could not start
        if (one != NIXL_SUCCESS) worst = one;
    }
    if (r->post_failed && worst == NIXL_SUCCESS) worst = NIXL_ERR_BACKEND;
    return worst;
}

void FileEngine::reap() const {
    std::lock_guard<std::mutex> g(pending_->mutex);
    for (auto *r : pending_->requests) {
        if (r->released) continue;
        bool active = false;
        nixl_status_t worst = NIXL_SUCCESS;
        for (auto x : r->xfers) {
            auto st = record<OrbiteXferState>();
            if (orbite_xfer_query(x, &st) != ORBITE_STATUS_OK) continue;
            nixl_status_t one = statusOf(st);
            if (one == NIXL_IN_PROG) active = true;
            else if (one != NIXL_SUCCESS && !(r->post_failed && one == NIXL_ERR_NOT_POSTED)) worst = one;
        }
        if (active) continue;
        for (auto x : r->xfers) orbite_xfer_release(x);
        r->final_status = r->post_failed && worst == NIXL_SUCCESS ? NIXL_ERR_BACKEND : worst;
        r->released = true;
    }
}

nixl_status_t FileEngine::releaseReqH(nixlBackendReqH *handle) const {
    auto *r = dynamic_cast<FileRequest *>(handle);
    if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
    reap();
    std::lock_guard<std::mutex> g(pending_->mutex);
    auto &list = pending_->requests;
    auto it = std::find(list.begin(), list.end(), r);
    if (!r->released) {
        for (auto x : r->xfers) {
            auto st = record<OrbiteXferState>();
            if (orbite_xfer_query(x, &st) == ORBITE_STATUS_OK && st.state == ORBITE_STATE_IN_PROGRESS) {
                // Negative: nothing released, nothing cancelled. Should NIXL
                // drop the request anyway, its transfers are released once
                // they retired.
                if (it == list.end()) list.push_back(r);
                r->release_pending = true;
                return NIXL_ERR_REPOST_ACTIVE;
            }
        }
        for (auto x : r->xfers) orbite_xfer_release(x);
    }
    if (it != list.end()) list.erase(it);
    delete r;
    return NIXL_SUCCESS;
}

nixl_status_t FileEngine::queryMem(const nixl_reg_dlist_t &descs, std::vector<nixl_query_resp_t> &resp) const {
    if (descs.getType() != FILE_SEG) return NIXL_ERR_NOT_SUPPORTED;
    resp.clear();
    for (const auto &d : descs) {
        // As NIXL's file backends do: the descriptor's metadata is a path,
        // answered from stat with size, mode and mtime; a missing file
        // answers no facts. A descriptor without a path whose devId is a
        // file registered here is answered from the engine's duplicate,
        // with what the engine applies to it.
        auto info = record<OrbiteFileInfo>();
        bool registered = false;
        {
            std::lock_guard<std::mutex> lock(files_->mutex);
            auto it = d.devId <= static_cast<uint64_t>(INT32_MAX) ? files_->by_fd.find(static_cast<int>(d.devId))
                                                                    : files_->by_fd.end();
            registered = it != files_->by_fd.end() && orbite_file_query(it->second, &info) == ORBITE_STATUS_OK;
        }
        struct stat st{};
        nixl_b_params_t facts;
        if (!d.metaInfo.empty()) {
            if (::stat(d.metaInfo.c_str(), &st) != 0) {
                resp.emplace_back(std::nullopt);
                continue;
            }
            facts = {{"size", std::to_string(st.st_size)},
                     {"mode", std::to_string(st.st_mode)},
                     {"mtime", std::to_string(st.st_mtime)}};
            // The engine's facts belong to this path only if it is the
            // same file.
            registered = registered && info.dev == st.st_dev && info.ino == st.st_ino;
        } else if (registered) {
            facts = {{"size", std::to_string(info.len)},
                     {"mode", std::to_string(info.st_mode)},
                     {"mtime", std::to_string(info.mtime_sec)}};
        } else {
            resp.emplace_back(std::nullopt);
            continue;
        }
        if (registered) {
            // What the registration gives, beyond NIXL's keys (docs/files.md).
            // (Each value a separate literal: GCC 12 at -O3 misreads a
            // choice between literals as an overlapping copy.)
            if ((info.flags & ORBITE_FILE_DIRECT) != 0)
                facts.emplace("direct", std::string(1, '1'));
            else
                facts.emplace("direct", std::string(1, '0'));
            std::string sync = "none";
            if ((info.flags & ORBITE_FILE_SYNC) != 0)
                sync.assign("O_SYNC");
            else if ((info.flags & ORBITE_FILE_DSYNC) != 0)
                sync.assign("O_DSYNC");
            facts.emplace("sync", std::move(sync));
            if ((info.flags & ORBITE_FILE_DIRECT) != 0) {
                facts["dio_mem_align"] = std::to_string(info.dio_mem_align);
                facts["dio_offset_align"] = std::to_string(info.dio_offset_align);
            }
        }
        resp.emplace_back(std::move(facts));
    }
    return NIXL_SUCCESS;
}

} // namespace orbite_nixl
