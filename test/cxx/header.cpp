// The C header from C++20 (-Wall -Wextra -Wpedantic -Werror): it compiles
// cleanly, its records are plain C layouts and its functions have C
// linkage (this program links against liborbite_nixl by the unmangled
// names, which fails if the declarations lost extern "C").
#include <orbite/nixl.h>
#include <orbite/nixl.h>  // include guard

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>

static_assert(std::is_same_v<std::underlying_type_t<OrbiteStatus>, std::int32_t>);
static_assert(sizeof(OrbiteStatus) == 4);
static_assert(ORBITE_STATUS_OK == 0 && ORBITE_STATUS_INTERNAL == -17);

template <typename T>
constexpr bool plain = std::is_standard_layout_v<T> && std::is_trivially_copyable_v<T> && std::is_trivial_v<T>;
static_assert(plain<OrbiteEngine> && plain<OrbiteRegistration> && plain<OrbiteShm> && plain<OrbitePeer> &&
              plain<OrbiteXfer> && plain<OrbiteAbiInfo> && plain<OrbiteEngineOptions> && plain<OrbiteMemRegion> &&
              plain<OrbiteDesc> && plain<OrbiteXferSpec> && plain<OrbiteXferState> && plain<OrbiteRemoteRange> &&
              plain<OrbiteCloseReport> && plain<OrbiteStats> && plain<OrbiteDrainResult> && plain<OrbiteNotifView>);

static_assert(sizeof(OrbiteEngine) == 8);
static_assert(sizeof(OrbiteAbiInfo) == 64);
static_assert(sizeof(OrbiteEngineOptions) == 40);
static_assert(sizeof(OrbiteMemRegion) == 56);
static_assert(sizeof(OrbiteDesc) == 24);
static_assert(sizeof(OrbiteXferSpec) == 88 && offsetof(OrbiteXferSpec, peer) == 32);
static_assert(sizeof(OrbiteXferState) == 72);
static_assert(sizeof(OrbiteStats) == 216 && offsetof(OrbiteStats, binding_handles) == 104 && offsetof(OrbiteStats, auth_failures) == 120 &&
              offsetof(OrbiteStats, connections) == 168);
static_assert(sizeof(OrbiteNotifView) == 48);

// The entry points have C language linkage: their addresses fit pointers
// declared inside extern "C".
extern "C" {
typedef OrbiteStatus (*abi_info_fn)(OrbiteAbiInfo *);
typedef OrbiteStatus (*xfer_prepare_fn)(OrbiteEngine, const OrbiteXferSpec *, OrbiteXfer *);
typedef OrbiteStatus (*notif_next_fn)(const uint8_t *, size_t, uint64_t *, OrbiteNotifView *);
}
static_assert(std::is_same_v<decltype(&orbite_abi_info), abi_info_fn>);
static_assert(std::is_same_v<decltype(&orbite_xfer_prepare), xfer_prepare_fn>);
static_assert(std::is_same_v<decltype(&orbite_notif_next), notif_next_fn>);

int main() {
    OrbiteAbiInfo info{};
    info.size = sizeof info;
    info.version = ORBITE_RECORD_VERSION;
    abi_info_fn f = &orbite_abi_info;
    OrbiteStatus s = f(&info);
    if (s != ORBITE_STATUS_OK || info.abi_major != ORBITE_ABI_MAJOR || info.size != sizeof(OrbiteAbiInfo) ||
        info.xfer_spec_size != sizeof(OrbiteXferSpec) || info.stats_size != sizeof(OrbiteStats)) {
        std::fprintf(stderr, "orbite_abi_info: status %d, abi %u.%u\n", static_cast<int>(s), info.abi_major,
                     info.abi_minor);
        return 1;
    }
    // A typed status converts like the C enum does.
    OrbiteStatus bad = orbite_abi_info(nullptr);
    if (bad != ORBITE_STATUS_INVALID_ARGUMENT) {
        std::fprintf(stderr, "orbite_abi_info(nullptr): status %d\n", static_cast<int>(bad));
        return 1;
    }
    std::printf("header.cpp: ok (abi %u.%u)\n", info.abi_major, info.abi_minor);
    return 0;
}
