/* A transfer on the self connection: fragmented WRITE with a binary
 * notification, READ back, guard bytes, notification drain and parse, a
 * release callback, and every charge back to zero at the end. */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>

#include "common.h"

#define GUARD 256                       /* outside each registered range */
#define SRC_REG_LEN ((3u << 20) + 4096) /* registered bytes */
#define DST_REG_LEN ((3u << 20) + 4096)
#define TOTAL 2600003u /* bytes each transfer moves: several route tasks */
#define SRC_FILL 0x5A /* src outside the pattern (after it is cleared) */
#define DST_FILL 0xA5 /* dst before the WRITE: its guard value */


/* Fragments with odd offsets and lengths and gaps between them; the last
 * length is 0 here and is computed so that each list covers TOTAL. */
static struct frag write_local[] = { { 3, 1000 }, { 1013, 65537 }, { 66600, 300001 }, { 366700, 123457 }, { 490200, 0 } };
static struct frag write_remote[] = { { 17, 4099 }, { 4200, 250000 }, { 254300, 77777 }, { 332100, 1 }, { 332200, 0 } };
static struct frag read_local[] = { { 1, 33333 }, { 40000, 7 }, { 40009, 500000 }, { 600001, 0 } };
static struct frag read_remote[] = { { 17, 4099 }, { 4200, 1 }, { 4202, 99999 }, { 110001, 262143 }, { 400000, 0 } };
#define N(a) (sizeof(a) / sizeof((a)[0]))

static void complete(struct frag *f, size_t n, uint64_t reg_len) {
    uint64_t sum = 0, end = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        CHECK(f[i].offset >= end && f[i].len > 0);
        sum += f[i].len;
        end = f[i].offset + f[i].len;
    }
    CHECK(sum < TOTAL && f[n - 1].offset >= end);
    f[n - 1].len = TOTAL - sum;
    CHECK(f[n - 1].offset + f[n - 1].len <= reg_len);
}

static void compare(const char *what, const uint8_t *got, const uint8_t *want, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            fprintf(stderr, "%s: byte %zu is %#x, expected %#x\n", what, i, got[i], want[i]);
            exit(1);
        }
    }
}

struct release_probe {
    atomic_int calls;
    atomic_int deregistered; /* set just before orbite_mem_deregister */
    atomic_int calls_before_deregistration;
    atomic_int freed;
};

static void on_release(void *context) {
    struct release_probe *p = context;
    if (!atomic_load(&p->deregistered)) {
        atomic_fetch_add(&p->calls_before_deregistration, 1);
    }
    if (atomic_load(&p->freed)) {
        fprintf(stderr, "release callback after free()\n");
        abort();
    }
    atomic_fetch_add(&p->calls, 1);
}

static OrbiteRegistration register_range(OrbiteEngine e, void *addr, uint64_t len, struct release_probe *probe) {
    OrbiteMemRegion r = REC(OrbiteMemRegion);
    r.addr = (uint64_t)(uintptr_t)addr;
    r.len = len;
    r.kind = ORBITE_MEM_DRAM;
    r.device = 0;
    r.permission = ORBITE_PERM_REMOTE_READ_WRITE;
    if (probe) {
        r.release = on_release;
        r.release_context = probe;
    }
    OrbiteRegistration reg = { 0 };
    OK(orbite_mem_register(e, &r, &reg));
    CHECK(reg.raw != 0);
    return reg;
}

static OrbiteXfer prepare(OrbiteEngine e, OrbitePeer peer, uint32_t op, uint32_t intent, const OrbiteDesc *local, size_t nl,
                          const OrbiteDesc *remote, size_t nr, const uint8_t *notif, size_t notif_len) {
    OrbiteXferSpec s = REC(OrbiteXferSpec);
    s.op = op;
    s.intent = intent;
    s.route = ORBITE_ROUTE_DEFAULT;
    s.flags = notif ? ORBITE_XFER_NOTIFY : 0;
    s.peer = peer;
    s.local = local;
    s.local_count = nl;
    s.remote = remote;
    s.remote_count = nr;
    s.notification = notif;
    s.notification_len = notif_len;
    OrbiteXfer x = { 0 };
    OK(orbite_xfer_prepare(e, &s, &x));
    CHECK(x.raw != 0);
    OrbiteXferState st = REC(OrbiteXferState);
    OK(orbite_xfer_query(x, &st));
    CHECK_EQ_U64(st.state, ORBITE_STATE_NOT_POSTED);
    CHECK_EQ_U64(st.total_bytes, TOTAL);
    CHECK_EQ_U64(st.drained, 0);
    return x;
}

static void run(OrbiteXfer x, const char *what) {
    OK(orbite_xfer_post(x));
    OrbiteXferState st = wait_retired(x, 60.0);
    if (st.code != ORBITE_OUTCOME_SUCCESS) {
        fprintf(stderr, "%s: outcome %u, effect %u, %" PRIu64 " of %" PRIu64 " bytes\n", what, st.code, st.remote_effect,
                st.transferred_bytes, st.total_bytes);
        exit(1);
    }
    CHECK_EQ_U64(st.drained, 1);
    CHECK_EQ_U64(st.phase, 0);
    CHECK_EQ_U64(st.route, ORBITE_ROUTE_LOOPBACK);
    CHECK_EQ_U64(st.transferred_prefix, TOTAL);
    CHECK_EQ_U64(st.transferred_bytes, TOTAL);
    CHECK_EQ_U64(st.total_bytes, TOTAL);
    CHECK_EQ_U64(st.remote_effect, ORBITE_EFFECT_KNOWN);
    CHECK_EQ_U64(st.execution, 1);
    CHECK(st.tasks_started > 1); /* task_bytes is 1 MiB by default */
    CHECK_EQ_U64(st.tasks_never_started, 0);
    printf("%s: retired, %u tasks, route loopback\n", what, st.tasks_started);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    complete(write_local, N(write_local), SRC_REG_LEN);
    complete(write_remote, N(write_remote), DST_REG_LEN);
    complete(read_local, N(read_local), SRC_REG_LEN);
    complete(read_remote, N(read_remote), DST_REG_LEN);

    uint8_t *src = malloc(SRC_REG_LEN + 2 * GUARD);
    uint8_t *dst = malloc(DST_REG_LEN + 2 * GUARD);
    uint8_t *want_src = malloc(SRC_REG_LEN + 2 * GUARD);
    uint8_t *want_dst = malloc(DST_REG_LEN + 2 * GUARD);
    CHECK(src && dst && want_src && want_dst);
    for (size_t i = 0; i < SRC_REG_LEN + 2 * GUARD; i++) {
        src[i] = (uint8_t)(i * 131u + (i >> 9) * 7u + 0x3Du);
    }
    memset(dst, DST_FILL, DST_REG_LEN + 2 * GUARD);
    uint8_t *src_reg = src + GUARD, *dst_reg = dst + GUARD;

    OrbiteEngine e = create_engine("{}");
    check_stats_zero(e, "fresh engine");

    struct release_probe probe;
    atomic_init(&probe.calls, 0);
    atomic_init(&probe.deregistered, 0);
    atomic_init(&probe.calls_before_deregistration, 0);
    atomic_init(&probe.freed, 0);
    OrbiteRegistration rs = register_range(e, src_reg, SRC_REG_LEN, NULL);
    OrbiteRegistration rd = register_range(e, dst_reg, DST_REG_LEN, &probe);

    /* The self peer, from this engine's own peer information. */
    size_t needed = 0;
    EXPECT_STATUS(orbite_engine_export_peer(e, NULL, 0, &needed), ORBITE_STATUS_BUFFER_TOO_SMALL);
    CHECK(needed > 0 && needed < 4096);
    uint8_t *info = malloc(needed);
    CHECK(info);
    size_t needed2 = 0;
    EXPECT_STATUS(orbite_engine_export_peer(e, info, needed - 1, &needed2), ORBITE_STATUS_BUFFER_TOO_SMALL);
    CHECK_EQ_U64(needed2, needed);
    OK(orbite_engine_export_peer(e, info, needed, &needed2));
    CHECK_EQ_U64(needed2, needed);
    OrbitePeer self = { 0 };
    OK(orbite_peer_open(e, info, needed, 10000, &self));
    CHECK(self.raw != 0);
    free(info);

    /* dst as a remote range of the self peer. */
    size_t mlen = 0;
    EXPECT_STATUS(orbite_mem_export(rd, NULL, 0, &mlen), ORBITE_STATUS_BUFFER_TOO_SMALL);
    CHECK(mlen > 0 && mlen < 4096);
    uint8_t *meta = malloc(mlen);
    CHECK(meta);
    OK(orbite_mem_export(rd, meta, mlen, &needed2));
    CHECK_EQ_U64(needed2, mlen);
    OrbiteRemoteRange rr = REC(OrbiteRemoteRange);
    OK(orbite_peer_import_range(self, meta, mlen, &rr));
    free(meta);
    CHECK(rr.remote_registration != 0);
    CHECK_EQ_U64(rr.addr, (uint64_t)(uintptr_t)dst_reg);
    CHECK_EQ_U64(rr.len, DST_REG_LEN);
    CHECK_EQ_U64(rr.permission, ORBITE_PERM_REMOTE_READ_WRITE);
    CHECK_EQ_U64(rr.shared, 0);

    /* Fragmented WRITE src -> dst with a binary notification. */
    static const uint8_t payload[] = { 'k', 'v', 0x00, 0xFF, 0x00, 0x00, 0xFF, 0xFE, 0x01, 'e', 'n', 'd', 0xFF, 0x00 };
    OrbiteDesc wl[N(write_local)], wr[N(write_remote)];
    descs(wl, write_local, N(write_local), rs.raw);
    descs(wr, write_remote, N(write_remote), rr.remote_registration);
    uint8_t notif_copy[sizeof payload];
    memcpy(notif_copy, payload, sizeof payload);
    OrbiteXfer xw = prepare(e, self, ORBITE_OP_WRITE, ORBITE_INTENT_NORMAL, wl, N(wl), wr, N(wr), notif_copy, sizeof notif_copy);
    memset(notif_copy, 0, sizeof notif_copy); /* copied at prepare */
    run(xw, "WRITE");
    memset(want_dst, DST_FILL, DST_REG_LEN + 2 * GUARD);
    apply(want_dst + GUARD, write_remote, N(write_remote), src_reg, write_local, N(write_local));
    compare("dst after WRITE (data and guards)", dst, want_dst, DST_REG_LEN + 2 * GUARD);
    printf("WRITE: %u bytes in %zu -> %zu fragments, guards intact\n", TOTAL, N(wl), N(wr));

    /* The notification: a too-small buffer first, then a big one. */
    OrbiteStats s = engine_stats(e);
    CHECK(s.notification_bytes > 0);
    uint8_t small[8];
    OrbiteDrainResult dr = REC(OrbiteDrainResult);
    EXPECT_STATUS(orbite_notifs_drain(e, small, sizeof small, &dr), ORBITE_STATUS_BUFFER_TOO_SMALL);
    CHECK_EQ_U64(dr.count, 0);
    CHECK_EQ_U64(dr.written, 0);
    CHECK(dr.next_needed >= 16 + sizeof payload);
    uint64_t next_needed = dr.next_needed;
    uint8_t *nbuf = malloc(65536);
    CHECK(nbuf);
    memset(nbuf, 0xCC, 65536);
    dr = REC(OrbiteDrainResult);
    OK(orbite_notifs_drain(e, nbuf, 65536, &dr));
    CHECK_EQ_U64(dr.count, 1);
    CHECK_EQ_U64(dr.written, next_needed);
    CHECK_EQ_U64(dr.next_needed, 0);
    uint64_t off = 0;
    OrbiteNotifView v = REC(OrbiteNotifView);
    OK(orbite_notif_next(nbuf, dr.written, &off, &v));
    CHECK_EQ_U64(off, dr.written);
    CHECK_EQ_U64(v.payload_len, sizeof payload);
    CHECK(v.payload >= nbuf && v.payload + v.payload_len <= nbuf + dr.written);
    CHECK(memcmp(v.payload, payload, sizeof payload) == 0);
    CHECK_EQ_U64(v.sender_len, 0); /* this engine has no listener */
    printf("notification: %" PRIu64 " payload bytes from epoch %#" PRIx64 ", sender \"%.*s\"\n", v.payload_len,
           v.sender_epoch, (int)v.sender_len, (const char *)v.sender);
    EXPECT_STATUS(orbite_notif_next(nbuf, dr.written, &off, &v), ORBITE_STATUS_NOT_FOUND);
    dr = REC(OrbiteDrainResult);
    OK(orbite_notifs_drain(e, nbuf, 65536, &dr));
    CHECK_EQ_U64(dr.count, 0);
    CHECK_EQ_U64(dr.next_needed, 0);
    free(nbuf);
    CHECK_EQ_U64(engine_stats(e).notification_bytes, 0);

    /* READ dst back into src, fragmented another way. */
    memset(src, SRC_FILL, SRC_REG_LEN + 2 * GUARD);
    OrbiteDesc rl[N(read_local)], rrd[N(read_remote)];
    descs(rl, read_local, N(read_local), rs.raw);
    descs(rrd, read_remote, N(read_remote), rr.remote_registration);
    OrbiteXfer xr = prepare(e, self, ORBITE_OP_READ, ORBITE_INTENT_DECODE_CRITICAL, rl, N(rl), rrd, N(rrd), NULL, 0);
    run(xr, "READ");
    memset(want_src, SRC_FILL, SRC_REG_LEN + 2 * GUARD);
    apply(want_src + GUARD, read_local, N(read_local), dst_reg, read_remote, N(read_remote));
    compare("src after READ (data and guards)", src, want_src, SRC_REG_LEN + 2 * GUARD);
    compare("dst after READ (unchanged)", dst, want_dst, DST_REG_LEN + 2 * GUARD);
    printf("READ: %u bytes in %zu <- %zu fragments, guards intact\n", TOTAL, N(rl), N(rrd));

    s = engine_stats(e);
    CHECK_EQ_U64(s.registrations, 2);
    CHECK_EQ_U64(s.registered_bytes, SRC_REG_LEN + DST_REG_LEN);
    CHECK_EQ_U64(s.prepared_transfers, 2);
    CHECK_EQ_U64(s.executions, 0);
    CHECK_EQ_U64(s.binding_handles, 5); /* 2 registrations, 1 peer, 2 transfers */

    /* Tear down, in the documented order. */
    OK(orbite_xfer_release(xw));
    OK(orbite_xfer_release(xr));
    EXPECT_STATUS(orbite_xfer_release(xw), ORBITE_STATUS_STALE_HANDLE);
    CHECK_EQ_U64(atomic_load(&probe.calls), 0);
    OK(orbite_mem_deregister(rs));
    atomic_store(&probe.deregistered, 1);
    OK(orbite_mem_deregister(rd));
    /* Nothing borrows dst any more: the callback runs now, or very soon on
     * whichever thread gave the range up last. */
    int immediate = atomic_load(&probe.calls);
    for (int i = 0; i < 50000 && atomic_load(&probe.calls) == 0; i++) {
        sleep_us(100);
    }
    CHECK_EQ_U64(atomic_load(&probe.calls), 1);
    CHECK_EQ_U64(atomic_load(&probe.calls_before_deregistration), 0);
    printf("release callback: ran once, %s\n", immediate ? "inside orbite_mem_deregister" : "after it returned");
    OK(orbite_peer_close(self, 5000));
    EXPECT_STATUS(orbite_peer_close(self, 5000), ORBITE_STATUS_STALE_HANDLE);
    check_stats_zero(e, "after teardown");

    OrbiteCloseReport rep = REC(OrbiteCloseReport);
    OK(orbite_engine_close(e, 5000, &rep));
    CHECK_EQ_U64(rep.drained, 1);
    CHECK_EQ_U64(rep.unquiesced, 0);
    check_stats_zero(e, "after close");
    OK(orbite_engine_release(e));
    EXPECT_STATUS(orbite_engine_release(e), ORBITE_STATUS_STALE_HANDLE);
    CHECK_EQ_U64(atomic_load(&probe.calls), 1);

    atomic_store(&probe.freed, 1);
    free(src);
    free(dst);
    free(want_src);
    free(want_dst);
    printf("local_transfer: ok\n");
    return 0;
}
