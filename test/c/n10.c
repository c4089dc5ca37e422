/* N10, the bad-input control: every malformed call fails with its typed
 * status and changes nothing (the engine's charges stay exactly as they
 * were), loading the library by a wrong name fails cleanly, and a panic
 * inside the library comes back as ORBITE_STATUS_INTERNAL. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>

#include "common.h"

#ifndef ORBITE_TEST_HOOKS
#error "build with -DORBITE_TEST_HOOKS (orbite_test_inject_panic)"
#endif
#ifndef ORBITE_LIB_DIR
#error "build with -DORBITE_LIB_DIR=<staged lib dir>"
#endif

typedef OrbiteStatus (*abi_info_fn)(OrbiteAbiInfo *);

/* (a) dlopen: a wrong name, the real one, a missing symbol. */
static void check_dlopen(void) {
    dlerror();
    void *none = dlopen("liborbite_nixl_does_not_exist.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(none == NULL);
    const char *why = dlerror();
    CHECK(why != NULL);
    printf("dlopen of a wrong name: NULL (%s)\n", why);

    void *by_path = dlopen(ORBITE_LIB_DIR "/liborbite_nixl.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!by_path) {
        fprintf(stderr, "dlopen %s: %s\n", ORBITE_LIB_DIR "/liborbite_nixl.so.1", dlerror());
        exit(1);
    }
    /* Already loaded (this program links it): found by its SONAME alone. */
    void *by_soname = dlopen("liborbite_nixl.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    CHECK(by_soname == by_path);

    void *sym = dlsym(by_path, "orbite_abi_info");
    CHECK(sym != NULL);
    abi_info_fn info_fn;
    memcpy(&info_fn, &sym, sizeof info_fn); /* object to function pointer without -Wpedantic's complaint */
    abi_info_fn linked = orbite_abi_info;
    CHECK(memcmp(&info_fn, &linked, sizeof info_fn) == 0);
    OrbiteAbiInfo info = REC(OrbiteAbiInfo);
    OK(info_fn(&info));
    CHECK_EQ_U64(info.abi_major, ORBITE_ABI_MAJOR);

    dlerror();
    CHECK(dlsym(by_path, "orbite_no_such_entry_point") == NULL);
    CHECK(dlerror() != NULL);
    CHECK(dlclose(by_soname) == 0);
    CHECK(dlclose(by_path) == 0);
    printf("dlopen by path and SONAME, dlsym, dlclose: ok\n");
}

static void create_expect(const OrbiteEngineOptions *o, OrbiteStatus expect, const char *mentions) {
    OrbiteEngine e = { 0x5A5A5A5A5A5A5A5Au };
    EXPECT_STATUS(orbite_engine_create(o, &e), expect);
    CHECK_EQ_U64(e.raw, 0x5A5A5A5A5A5A5A5Au); /* no output on failure */
    const char *msg = last_error();
    CHECK(msg[0] != '\0');
    if (mentions && !strstr(msg, mentions)) {
        fprintf(stderr, "orbite_last_error \"%s\" does not mention \"%s\"\n", msg, mentions);
        exit(1);
    }
    printf("  create refused: %s (%s)\n", status_name(expect), msg);
}

/* (b) engine creation with bad options. */
static void check_create(void) {
    static const char empty[] = "{}";
    OrbiteEngineOptions good = REC(OrbiteEngineOptions);
    good.abi_major = ORBITE_ABI_MAJOR;
    good.config_json = (const uint8_t *)empty;
    good.config_json_len = 2;

    OrbiteEngineOptions o = good;
    o.abi_major = ORBITE_ABI_MAJOR + 1;
    create_expect(&o, ORBITE_STATUS_VERSION_MISMATCH, NULL);
    o = good;
    o.size = sizeof(OrbiteEngineOptions) - 8;
    create_expect(&o, ORBITE_STATUS_VERSION_MISMATCH, NULL);
    o = good;
    o.version = 2;
    create_expect(&o, ORBITE_STATUS_VERSION_MISMATCH, NULL);
    o = good;
    o.required_features = UINT64_C(1) << 40;
    create_expect(&o, ORBITE_STATUS_NOT_SUPPORTED, NULL);
    static const char unknown[] = "{\"no_such_field\":1}";
    o = good;
    o.config_json = (const uint8_t *)unknown;
    o.config_json_len = strlen(unknown);
    create_expect(&o, ORBITE_STATUS_INVALID_ARGUMENT, "no_such_field");
    create_expect(NULL, ORBITE_STATUS_INVALID_ARGUMENT, NULL);

    /* And the good options do create (no engine leaks from the refusals). */
    OrbiteEngine e = { 0 };
    OK(orbite_engine_create(&good, &e));
    check_stats_zero(e, "fresh engine");
    OK(orbite_engine_release(e));
}

static OrbiteStats S0;
static OrbiteEngine E1;

/* The engine's charges are exactly S0. */
#define SAME_STATS()                                                                   \
    do {                                                                               \
        OrbiteStats now_ = engine_stats(E1);                                           \
        if (memcmp(&now_, &S0, sizeof S0) != 0) {                                      \
            fprintf(stderr, "%s:%d: stats changed after a failed call\n", __FILE__, __LINE__); \
            print_stats("S0 ", &S0);                                                   \
            print_stats("now", &now_);                                                 \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* A failed call: its status, a message, and no change of the charges. */
#define REFUSED(call, expect)                                                   \
    do {                                                                        \
        EXPECT_STATUS(call, expect);                                            \
        const char *msg_ = last_error();                                        \
        CHECK(msg_[0] != '\0');                                                 \
        printf("  %-18s %s\n", status_name(expect), msg_);                      \
        SAME_STATS();                                                           \
    } while (0)

static OrbiteMemRegion region(void *addr, uint64_t len) {
    OrbiteMemRegion r = REC(OrbiteMemRegion);
    r.addr = (uint64_t)(uintptr_t)addr;
    r.len = len;
    r.kind = ORBITE_MEM_DRAM;
    r.permission = ORBITE_PERM_REMOTE_READ_WRITE;
    return r;
}

static OrbitePeer self_peer(OrbiteEngine e) {
    uint8_t info[4096];
    size_t n = 0;
    OK(orbite_engine_export_peer(e, info, sizeof info, &n));
    OrbitePeer p = { 0 };
    OK(orbite_peer_open(e, info, n, 10000, &p));
    return p;
}

static OrbiteRemoteRange import_self(OrbitePeer p, OrbiteRegistration r) {
    uint8_t meta[4096];
    size_t n = 0;
    OK(orbite_mem_export(r, meta, sizeof meta, &n));
    OrbiteRemoteRange rr = REC(OrbiteRemoteRange);
    OK(orbite_peer_import_range(p, meta, n, &rr));
    return rr;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("(a) dlopen\n");
    check_dlopen();
    printf("(b) engine creation\n");
    check_create();

    printf("(c) failed calls change nothing\n");
    enum { LEN = 65536 };
    uint8_t *buf_a = malloc(LEN), *buf_b = malloc(LEN), *buf_c = malloc(LEN);
    CHECK(buf_a && buf_b && buf_c);
    memset(buf_a, 1, LEN);
    memset(buf_b, 2, LEN);
    memset(buf_c, 3, LEN);

    E1 = create_engine("{}");
    OrbiteEngine e2 = create_engine("{}");
    OrbiteMemRegion ra = region(buf_a, LEN);
    OrbiteRegistration reg_a = { 0 }, reg_c = { 0 }, reg_e2 = { 0 };
    OK(orbite_mem_register(E1, &ra, &reg_a));
    OrbiteMemRegion rc = region(buf_c, LEN);
    OK(orbite_mem_register(E1, &rc, &reg_c));
    OrbiteMemRegion rb = region(buf_b, LEN);
    OK(orbite_mem_register(e2, &rb, &reg_e2));
    OrbitePeer self = self_peer(E1);
    OrbiteRemoteRange rr_a = import_self(self, reg_a);

    /* A valid spec (WRITE a[0..4096) onto a[8192..12288)), the template of
     * every malformed one below. */
    OrbiteDesc local = { .registration = reg_a.raw, .offset = 0, .len = 4096 };
    OrbiteDesc remote = { .registration = rr_a.remote_registration, .offset = 8192, .len = 4096 };
    OrbiteXferSpec good = REC(OrbiteXferSpec);
    good.op = ORBITE_OP_WRITE;
    good.peer = self;
    good.local = &local;
    good.local_count = 1;
    good.remote = &remote;
    good.remote_count = 1;
    OrbiteXfer live = { 0 }, released = { 0 };
    OK(orbite_xfer_prepare(E1, &good, &live)); /* kept alive through S0 */
    OK(orbite_xfer_prepare(E1, &good, &released));
    OK(orbite_xfer_release(released));
    OrbiteRegistration stale_reg = reg_c;
    OK(orbite_mem_deregister(reg_c));

    S0 = engine_stats(E1);
    print_stats("S0", &S0);
    CHECK_EQ_U64(S0.registrations, 1);
    CHECK_EQ_U64(S0.prepared_transfers, 1);
    CHECK_EQ_U64(S0.binding_handles, 3); /* reg_a, self, live */

    OrbiteXfer out = { 0x77 };
    OrbiteXferSpec s;
    OrbiteDesc d;

    /* Stale handles. */
    d = local;
    d.registration = stale_reg.raw;
    s = good;
    s.local = &d;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_STALE_HANDLE);
    REFUSED(orbite_mem_deregister(stale_reg), ORBITE_STATUS_STALE_HANDLE);
    REFUSED(orbite_xfer_release(released), ORBITE_STATUS_STALE_HANDLE);
    OrbiteXferState qs = REC(OrbiteXferState);
    REFUSED(orbite_xfer_query(released, &qs), ORBITE_STATUS_STALE_HANDLE);
    REFUSED(orbite_xfer_post(released), ORBITE_STATUS_STALE_HANDLE);

    /* Handles of another kind or another engine. */
    d = local;
    d.registration = self.raw;
    s = good;
    s.local = &d;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_WRONG_HANDLE);
    OrbiteXfer fake_xfer = { reg_a.raw };
    REFUSED(orbite_xfer_query(fake_xfer, &qs), ORBITE_STATUS_WRONG_HANDLE);
    REFUSED(orbite_xfer_post(fake_xfer), ORBITE_STATUS_WRONG_HANDLE);
    REFUSED(orbite_xfer_release(fake_xfer), ORBITE_STATUS_WRONG_HANDLE);
    OrbiteRegistration fake_reg = { live.raw };
    REFUSED(orbite_mem_deregister(fake_reg), ORBITE_STATUS_WRONG_HANDLE);
    OrbiteEngine fake_engine = { reg_a.raw };
    OrbiteStats st = REC(OrbiteStats);
    REFUSED(orbite_engine_stats(fake_engine, &st), ORBITE_STATUS_WRONG_HANDLE);
    REFUSED(orbite_engine_release(fake_engine), ORBITE_STATUS_WRONG_HANDLE);
    d = local;
    d.registration = reg_e2.raw;
    s = good;
    s.local = &d;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_WRONG_HANDLE);
    s = good; /* E1's peer used with e2 */
    REFUSED(orbite_xfer_prepare(e2, &s, &out), ORBITE_STATUS_WRONG_HANDLE);

    /* Zero and garbage. */
    d = local;
    d.registration = 0;
    s = good;
    s.local = &d;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_STALE_HANDLE);
    REFUSED(orbite_engine_stats((OrbiteEngine){ 0 }, &st), ORBITE_STATUS_STALE_HANDLE);
    REFUSED(orbite_xfer_query((OrbiteXfer){ 0 }, &qs), ORBITE_STATUS_STALE_HANDLE);
    d.registration = UINT64_C(0x123456789);
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_WRONG_HANDLE);
    REFUSED(orbite_xfer_query((OrbiteXfer){ UINT64_C(0x123456789) }, &qs), ORBITE_STATUS_WRONG_HANDLE);
    s = good;
    s.peer.raw = UINT64_C(0x123456789);
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_WRONG_HANDLE);

    /* Counts, ranges and enumerations. */
    s = good;
    s.local = NULL;
    s.local_count = UINT64_C(1) << 40;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_RESOURCE_EXHAUSTED);
    s = good;
    s.remote = NULL;
    s.remote_count = UINT64_C(1) << 40;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_RESOURCE_EXHAUSTED);
    OrbiteRegistration nreg = { 0x99 };
    OrbiteMemRegion bad = region(buf_b, UINT64_MAX - 10);
    REFUSED(orbite_mem_register(E1, &bad, &nreg), ORBITE_STATUS_OUT_OF_RANGE);
    bad = region((void *)(uintptr_t)UINT64_C(0xFFFFFFFFFFFFF000), 0x2000);
    REFUSED(orbite_mem_register(E1, &bad, &nreg), ORBITE_STATUS_OUT_OF_RANGE);
    d = local;
    d.offset = UINT64_MAX - 1;
    d.len = 16;
    s = good;
    s.local = &d;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_OUT_OF_RANGE);
    OrbiteDesc rd = remote;
    rd.offset = UINT64_MAX - 1;
    rd.len = 16;
    s = good;
    s.remote = &rd;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_OUT_OF_RANGE);
    s = good;
    s.op = 7;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_INVALID_ARGUMENT);
    bad = region(buf_b, LEN);
    bad.kind = ORBITE_MEM_VRAM;
    REFUSED(orbite_mem_register(E1, &bad, &nreg), ORBITE_STATUS_NOT_SUPPORTED);
    CHECK_EQ_U64(nreg.raw, 0x99);
    CHECK_EQ_U64(out.raw, 0x77);

    /* Output records with a wrong size: refused, left untouched. */
    OrbiteStats wrong = REC(OrbiteStats);
    wrong.size -= 8;
    OrbiteStats wrong_copy = wrong;
    REFUSED(orbite_engine_stats(E1, &wrong), ORBITE_STATUS_VERSION_MISMATCH);
    CHECK(memcmp(&wrong, &wrong_copy, sizeof wrong) == 0);
    OrbiteXferState wq = REC(OrbiteXferState);
    wq.size += 8;
    REFUSED(orbite_xfer_query(live, &wq), ORBITE_STATUS_VERSION_MISMATCH);
    CHECK_EQ_U64(wq.state, 0);
    OrbiteAbiInfo wi = REC(OrbiteAbiInfo);
    wi.version = 0;
    REFUSED(orbite_abi_info(&wi), ORBITE_STATUS_VERSION_MISMATCH);
    CHECK_EQ_U64(wi.abi_major, 0);
    OrbiteDrainResult wd = REC(OrbiteDrainResult);
    wd.size = 1;
    uint8_t nb[256];
    REFUSED(orbite_notifs_drain(E1, nb, sizeof nb, &wd), ORBITE_STATUS_VERSION_MISMATCH);
    s = good;
    s.size = sizeof(OrbiteXferSpec) + 8;
    REFUSED(orbite_xfer_prepare(E1, &s, &out), ORBITE_STATUS_VERSION_MISMATCH);

    /* (d) A panic inside the library comes back as INTERNAL. */
    printf("(d) injected panic\n");
    OrbiteAbiInfo info = REC(OrbiteAbiInfo);
    OK(orbite_abi_info(&info));
    CHECK((info.features & ORBITE_FEATURE_TEST_HOOKS) != 0);
    OK(orbite_test_inject_panic());
    st = REC(OrbiteStats);
    fprintf(stderr, "(a panic message from the library's panic hook is expected next)\n");
    EXPECT_STATUS(orbite_engine_stats(E1, &st), ORBITE_STATUS_INTERNAL);
    const char *msg = last_error();
    if (!strstr(msg, "panic")) {
        fprintf(stderr, "orbite_last_error \"%s\" does not mention the panic\n", msg);
        return 1;
    }
    printf("  INTERNAL           %s\n", msg);
    SAME_STATS(); /* the next call works normally */
    CHECK(last_error()[0] == '\0');
    OrbiteXferState ls = REC(OrbiteXferState);
    OK(orbite_xfer_query(live, &ls));
    CHECK_EQ_U64(ls.state, ORBITE_STATE_NOT_POSTED);
    SAME_STATS();

    /* Release everything: every charge back to zero, engines released. */
    REFUSED(orbite_engine_release(E1), ORBITE_STATUS_ACTIVE);
    OK(orbite_xfer_release(live));
    OK(orbite_mem_deregister(reg_a));
    OK(orbite_peer_close(self, 5000));
    check_stats_zero(E1, "E1 at the end");
    OK(orbite_mem_deregister(reg_e2));
    check_stats_zero(e2, "e2 at the end");
    OrbiteCloseReport rep = REC(OrbiteCloseReport);
    OK(orbite_engine_close(E1, 5000, &rep));
    CHECK_EQ_U64(rep.drained, 1);
    OK(orbite_engine_close(e2, 5000, NULL));
    OK(orbite_engine_release(E1));
    OK(orbite_engine_release(e2));
    free(buf_a);
    free(buf_b);
    free(buf_c);
    printf("n10: ok\n");
    return 0;
}
