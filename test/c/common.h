/* Shared helpers of the C ABI consumer tests (test/c, test/cxx). */
#ifndef ORBITE_TEST_COMMON_H
#define ORBITE_TEST_COMMON_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* nanosleep, clock_gettime, getline, fork */
#endif

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <orbite/nixl.h>

/* The header's bit 63 must be a 64-bit constant (a C `1 << 63` would shift
 * an int): check that it is the value the library reports. */
_Static_assert(ORBITE_FEATURE_TEST_HOOKS == (UINT64_C(1) << 63), "feature bit 63 is a 64-bit constant");

#define REC(T) ((T){ .size = (uint32_t)sizeof(T), .version = ORBITE_RECORD_VERSION })

static inline const char *status_name(OrbiteStatus s) {
    switch ((int)s) {
    case ORBITE_STATUS_OK: return "OK";
    case ORBITE_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case ORBITE_STATUS_STALE_HANDLE: return "STALE_HANDLE";
    case ORBITE_STATUS_WRONG_HANDLE: return "WRONG_HANDLE";
    case ORBITE_STATUS_VERSION_MISMATCH: return "VERSION_MISMATCH";
    case ORBITE_STATUS_BUFFER_TOO_SMALL: return "BUFFER_TOO_SMALL";
    case ORBITE_STATUS_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case ORBITE_STATUS_ACTIVE: return "ACTIVE";
    case ORBITE_STATUS_REFUSED: return "REFUSED";
    case ORBITE_STATUS_NOT_FOUND: return "NOT_FOUND";
    case ORBITE_STATUS_NOT_ALLOWED: return "NOT_ALLOWED";
    case ORBITE_STATUS_NOT_SUPPORTED: return "NOT_SUPPORTED";
    case ORBITE_STATUS_REMOTE_DISCONNECT: return "REMOTE_DISCONNECT";
    case ORBITE_STATUS_EPOCH_MISMATCH: return "EPOCH_MISMATCH";
    case ORBITE_STATUS_CLOSED: return "CLOSED";
    case ORBITE_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case ORBITE_STATUS_SYSTEM: return "SYSTEM";
    case ORBITE_STATUS_INTERNAL: return "INTERNAL";
    default: return "(unknown status)";
    }
}

/* This thread's last error message (a static buffer per thread). */
static inline const char *last_error(void) {
    static _Thread_local char buf[4096];
    size_t needed = 0;
    OrbiteStatus s = orbite_last_error(buf, sizeof buf, &needed);
    if (s != ORBITE_STATUS_OK) {
        snprintf(buf, sizeof buf, "(orbite_last_error failed: %s, needed %zu)", status_name(s), needed);
    }
    return buf;
}

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            fflush(stderr);                                                         \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_EQ_U64(a, b)                                                                              \
    do {                                                                                                \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                                                \
        if (a_ != b_) {                                                                                 \
            fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%" PRIu64 " != %" PRIu64 ")\n", __FILE__,  \
                    __LINE__, #a, #b, a_, b_);                                                          \
            fflush(stderr);                                                                             \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

/* `call` must return `expect`; otherwise print both and the last error. */
#define EXPECT_STATUS(call, expect)                                                                    \
    do {                                                                                               \
        OrbiteStatus st_ = (call);                                                                     \
        if (st_ != (expect)) {                                                                         \
            const char *msg_ = last_error();                                                           \
            fprintf(stderr, "%s:%d: %s returned %s (%d), expected %s; orbite_last_error: \"%s\"\n",    \
                    __FILE__, __LINE__, #call, status_name(st_), (int)st_, status_name(expect), msg_); \
            fflush(stderr);                                                                            \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

#define OK(call) EXPECT_STATUS(call, ORBITE_STATUS_OK)

static inline OrbiteEngine create_engine(const char *json) {
    OrbiteEngineOptions o = REC(OrbiteEngineOptions);
    o.abi_major = ORBITE_ABI_MAJOR;
    o.config_json = (const uint8_t *)json;
    o.config_json_len = strlen(json);
    OrbiteEngine e = { 0 };
    OK(orbite_engine_create(&o, &e));
    CHECK(e.raw != 0);
    return e;
}

static inline OrbiteStats engine_stats(OrbiteEngine e) {
    OrbiteStats s = REC(OrbiteStats);
    OK(orbite_engine_stats(e, &s));
    return s;
}

static inline void print_stats(const char *what, const OrbiteStats *s) {
    fprintf(stderr,
            "%s: registrations=%" PRIu64 " registered_bytes=%" PRIu64 " fenced=%" PRIu64 " host_allocations=%" PRIu64
            " host_memory_bytes=%" PRIu64 " prepared=%" PRIu64 " executions=%" PRIu64 " queued=%" PRIu64
            " bytes_in_flight=%" PRIu64 " tasks_in_flight=%" PRIu64 " unquiesced=%" PRIu64
            " notification_bytes=%" PRIu64 " binding_handles=%" PRIu64 "\n",
            what, s->registrations, s->registered_bytes, s->fenced_registrations, s->host_allocations,
            s->host_memory_bytes, s->prepared_transfers, s->executions, s->queued_executions, s->bytes_in_flight,
            s->tasks_in_flight, s->unquiesced_owners, s->notification_bytes, s->binding_handles);
}

/* Every charge of the engine is zero. */
static inline void check_stats_zero(OrbiteEngine e, const char *what) {
    OrbiteStats s = engine_stats(e);
    CHECK_EQ_U64(s.size, sizeof(OrbiteStats));
    CHECK_EQ_U64(s.version, ORBITE_RECORD_VERSION);
    if (s.registrations || s.registered_bytes || s.fenced_registrations || s.host_allocations ||
        s.host_memory_bytes || s.prepared_transfers || s.executions || s.queued_executions || s.bytes_in_flight ||
        s.tasks_in_flight || s.unquiesced_owners || s.notification_bytes || s.binding_handles) {
        print_stats(what, &s);
        fprintf(stderr, "%s: a charge is not zero\n", what);
        exit(1);
    }
}

static inline void sleep_us(long us) {
    struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000 };
    nanosleep(&ts, NULL);
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Polls until the transfer's execution retired (at most `limit_s`). */
static inline OrbiteXferState wait_retired(OrbiteXfer x, double limit_s) {
    double until = now_s() + limit_s;
    for (unsigned long i = 0;; i++) {
        OrbiteXferState st = REC(OrbiteXferState);
        OK(orbite_xfer_query(x, &st));
        if (st.state == ORBITE_STATE_RETIRED) {
            return st;
        }
        CHECK(st.state == ORBITE_STATE_IN_PROGRESS);
        CHECK(st.drained == 0);
        if (now_s() > until) {
            fprintf(stderr, "transfer not retired after %.0f s (%lu polls): state %u phase %u bytes %" PRIu64 "/%" PRIu64 "\n",
                    limit_s, i, st.state, st.phase, st.transferred_bytes, st.total_bytes);
            exit(1);
        }
        sleep_us(100);
    }
}

/* 64-bit FNV-1a. */
static inline uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= UINT64_C(0x100000001b3);
    }
    return h;
}

/* A fragment of a buffer: `len` bytes at `offset`. */
struct frag {
    uint64_t offset, len;
};

/* Descriptors of fragments of one registration. */
static inline void descs(OrbiteDesc *d, const struct frag *f, size_t n, uint64_t registration) {
    for (size_t i = 0; i < n; i++) {
        d[i] = (OrbiteDesc){ .registration = registration, .offset = f[i].offset, .len = f[i].len };
    }
}

/* Applies the byte stream of `from` (fragments of `src`) to `to`
 * (fragments of `dst`), the way a transfer maps them. */
static inline void apply(uint8_t *dst, const struct frag *to, size_t nt, const uint8_t *src, const struct frag *from, size_t nf) {
    size_t i = 0, j = 0;
    uint64_t oi = 0, oj = 0;
    while (i < nf && j < nt) {
        uint64_t n = from[i].len - oi;
        if (to[j].len - oj < n) {
            n = to[j].len - oj;
        }
        memcpy(dst + to[j].offset + oj, src + from[i].offset + oi, n);
        oi += n;
        oj += n;
        if (oi == from[i].len) {
            i++;
            oi = 0;
        }
        if (oj == to[j].len) {
            j++;
            oj = 0;
        }
    }
    CHECK(i == nf && j == nt);
}

#endif /* ORBITE_TEST_COMMON_H */
