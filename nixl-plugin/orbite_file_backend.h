// SPDX-License-Identifier: Apache-2.0
// The local-only NIXL backend "ORBITE_FILE": files and DRAM of this process,
// moved by OrbiTE's file route (io_uring) through the C ABI. It follows
// NIXL's file convention: a FILE_SEG descriptor's device id is the file
// descriptor and its address the file offset. See docs/nixl-plugin.md.
#ifndef ORBITE_NIXL_FILE_BACKEND_H
#define ORBITE_NIXL_FILE_BACKEND_H

#include <memory>
#include <string>
#include <vector>

#include "backend/backend_engine.h"

#include <orbite/nixl.h>

namespace orbite_nixl {

class FileEngine : public nixlBackendEngine {
public:
    explicit FileEngine(const nixlBackendInitParams *init_params);
    ~FileEngine() override;

    bool supportsRemote() const override { return false; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return false; }
    nixl_mem_list_t getSupportedMems() const override;

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) override;
    nixl_status_t deregisterMem(nixlBackendMD *meta) override;
    nixl_status_t connect(const std::string &remote_agent) override;
    nixl_status_t disconnect(const std::string &remote_agent) override;
    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override;
    nixl_status_t unloadMD(nixlBackendMD *input) override;

    nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const override;
    nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt_args = nullptr) const override;
    nixl_status_t checkXfer(nixlBackendReqH *handle) const override;
    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override;

    nixl_status_t queryMem(const nixl_reg_dlist_t &descs, std::vector<nixl_query_resp_t> &resp) const override;

    OrbiteEngine orbiteEngine() const { return engine_; }

private:
    // Releases the transfers of requests whose release was refused while
    // active, once they retired.
    void reap() const;

    OrbiteEngine engine_{};
    std::shared_ptr<struct Pending> pending_;
    std::shared_ptr<struct Files> files_;
};

} // namespace orbite_nixl

#endif
