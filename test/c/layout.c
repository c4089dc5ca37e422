/* Layout of every record of include/orbite/nixl.h on LP64, with the numbers
 * worked out by hand from the declarations (natural C alignment): checked at
 * compile time, against test/c/layout.expected (which a Rust test compares
 * with Rust's own offsets) and against what orbite_abi_info reports. */
#define _POSIX_C_SOURCE 200809L
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

_Static_assert(sizeof(void *) == 8 && sizeof(size_t) == 8 && sizeof(long) == 8, "LP64 only");
_Static_assert(sizeof(OrbiteStatus) == 4, "OrbiteStatus is 32 bits");

/* S(record, size) and F(record, field, offset), one per record and field. */
#define LAYOUT(S, F)                              \
    S(OrbiteEngine, 8)                            \
    F(OrbiteEngine, raw, 0)                       \
    S(OrbiteRegistration, 8)                      \
    F(OrbiteRegistration, raw, 0)                 \
    S(OrbiteShm, 8)                               \
    F(OrbiteShm, raw, 0)                          \
    S(OrbitePeer, 8)                              \
    F(OrbitePeer, raw, 0)                         \
    S(OrbiteXfer, 8)                              \
    F(OrbiteXfer, raw, 0)                         \
    S(OrbiteFile, 8)                              \
    F(OrbiteFile, raw, 0)                         \
    S(OrbiteFileInfo, 72)                         \
    F(OrbiteFileInfo, size, 0)                    \
    F(OrbiteFileInfo, version, 4)                 \
    F(OrbiteFileInfo, mode, 8)                    \
    F(OrbiteFileInfo, closed, 12)                 \
    F(OrbiteFileInfo, len, 16)                    \
    F(OrbiteFileInfo, dev, 24)                    \
    F(OrbiteFileInfo, ino, 32)                    \
    F(OrbiteFileInfo, st_mode, 40)                \
    F(OrbiteFileInfo, flags, 44)                  \
    F(OrbiteFileInfo, mtime_sec, 48)              \
    F(OrbiteFileInfo, mtime_nsec, 56)             \
    F(OrbiteFileInfo, dio_mem_align, 60)          \
    F(OrbiteFileInfo, dio_offset_align, 64)       \
    F(OrbiteFileInfo, reserved, 68)               \
    S(OrbiteAbiInfo, 64)                          \
    F(OrbiteAbiInfo, size, 0)                     \
    F(OrbiteAbiInfo, version, 4)                  \
    F(OrbiteAbiInfo, abi_major, 8)                \
    F(OrbiteAbiInfo, abi_minor, 12)               \
    F(OrbiteAbiInfo, features, 16)                \
    F(OrbiteAbiInfo, engine_options_size, 24)     \
    F(OrbiteAbiInfo, mem_region_size, 28)         \
    F(OrbiteAbiInfo, desc_size, 32)               \
    F(OrbiteAbiInfo, xfer_spec_size, 36)          \
    F(OrbiteAbiInfo, xfer_state_size, 40)         \
    F(OrbiteAbiInfo, remote_range_size, 44)       \
    F(OrbiteAbiInfo, close_report_size, 48)       \
    F(OrbiteAbiInfo, stats_size, 52)              \
    F(OrbiteAbiInfo, drain_result_size, 56)       \
    F(OrbiteAbiInfo, notif_view_size, 60)         \
    S(OrbiteEngineOptions, 40)                    \
    F(OrbiteEngineOptions, size, 0)               \
    F(OrbiteEngineOptions, version, 4)            \
    F(OrbiteEngineOptions, abi_major, 8)          \
    F(OrbiteEngineOptions, flags, 12)             \
    F(OrbiteEngineOptions, required_features, 16) \
    F(OrbiteEngineOptions, config_json, 24)       \
    F(OrbiteEngineOptions, config_json_len, 32)   \
    S(OrbiteMemRegion, 56)                        \
    F(OrbiteMemRegion, size, 0)                   \
    F(OrbiteMemRegion, version, 4)                \
    F(OrbiteMemRegion, addr, 8)                   \
    F(OrbiteMemRegion, len, 16)                   \
    F(OrbiteMemRegion, kind, 24)                  \
    F(OrbiteMemRegion, device, 28)                \
    F(OrbiteMemRegion, permission, 32)            \
    F(OrbiteMemRegion, reserved, 36)              \
    F(OrbiteMemRegion, release, 40)               \
    F(OrbiteMemRegion, release_context, 48)       \
    S(OrbiteDesc, 24)                             \
    F(OrbiteDesc, registration, 0)                \
    F(OrbiteDesc, offset, 8)                      \
    F(OrbiteDesc, len, 16)                        \
    S(OrbiteXferSpec, 88)                         \
    F(OrbiteXferSpec, size, 0)                    \
    F(OrbiteXferSpec, version, 4)                 \
    F(OrbiteXferSpec, op, 8)                      \
    F(OrbiteXferSpec, intent, 12)                 \
    F(OrbiteXferSpec, route, 16)                  \
    F(OrbiteXferSpec, flags, 20)                  \
    F(OrbiteXferSpec, deadline_us, 24)            \
    F(OrbiteXferSpec, peer, 32)                   \
    F(OrbiteXferSpec, local, 40)                  \
    F(OrbiteXferSpec, local_count, 48)            \
    F(OrbiteXferSpec, remote, 56)                 \
    F(OrbiteXferSpec, remote_count, 64)           \
    F(OrbiteXferSpec, notification, 72)           \
    F(OrbiteXferSpec, notification_len, 80)       \
    S(OrbiteXferState, 72)                        \
    F(OrbiteXferState, size, 0)                   \
    F(OrbiteXferState, version, 4)                \
    F(OrbiteXferState, state, 8)                  \
    F(OrbiteXferState, phase, 12)                 \
    F(OrbiteXferState, code, 16)                  \
    F(OrbiteXferState, remote_effect, 20)         \
    F(OrbiteXferState, drained, 24)               \
    F(OrbiteXferState, route, 28)                 \
    F(OrbiteXferState, transferred_bytes, 32)     \
    F(OrbiteXferState, transferred_prefix, 40)    \
    F(OrbiteXferState, total_bytes, 48)           \
    F(OrbiteXferState, execution, 56)             \
    F(OrbiteXferState, tasks_started, 64)         \
    F(OrbiteXferState, tasks_never_started, 68)   \
    S(OrbiteRemoteRange, 40)                      \
    F(OrbiteRemoteRange, size, 0)                 \
    F(OrbiteRemoteRange, version, 4)              \
    F(OrbiteRemoteRange, remote_registration, 8)  \
    F(OrbiteRemoteRange, addr, 16)                \
    F(OrbiteRemoteRange, len, 24)                 \
    F(OrbiteRemoteRange, permission, 32)          \
    F(OrbiteRemoteRange, shared, 36)              \
    S(OrbiteCloseReport, 24)                      \
    F(OrbiteCloseReport, size, 0)                 \
    F(OrbiteCloseReport, version, 4)              \
    F(OrbiteCloseReport, drained, 8)              \
    F(OrbiteCloseReport, reserved, 12)            \
    F(OrbiteCloseReport, unquiesced, 16)          \
    S(OrbiteStats, 216)                           \
    F(OrbiteStats, size, 0)                       \
    F(OrbiteStats, version, 4)                    \
    F(OrbiteStats, registrations, 8)              \
    F(OrbiteStats, registered_bytes, 16)          \
    F(OrbiteStats, fenced_registrations, 24)      \
    F(OrbiteStats, host_allocations, 32)          \
    F(OrbiteStats, host_memory_bytes, 40)         \
    F(OrbiteStats, prepared_transfers, 48)        \
    F(OrbiteStats, executions, 56)                \
    F(OrbiteStats, queued_executions, 64)         \
    F(OrbiteStats, bytes_in_flight, 72)           \
    F(OrbiteStats, tasks_in_flight, 80)           \
    F(OrbiteStats, unquiesced_owners, 88)         \
    F(OrbiteStats, notification_bytes, 96)        \
    F(OrbiteStats, binding_handles, 104)          \
    F(OrbiteStats, pinned_ranges, 112)            \
    F(OrbiteStats, auth_failures, 120)            \
    F(OrbiteStats, device_allocations, 128)       \
    F(OrbiteStats, device_memory_bytes, 136)      \
    F(OrbiteStats, staging_buffers, 144)          \
    F(OrbiteStats, staging_bytes, 152)            \
    F(OrbiteStats, cuda_imports, 160)             \
    F(OrbiteStats, connections, 168)              \
    F(OrbiteStats, connections_refused, 176)      \
    F(OrbiteStats, frame_buffer_bytes, 184)       \
    F(OrbiteStats, borrows, 192)                  \
    F(OrbiteStats, borrow_bytes, 200)             \
    F(OrbiteStats, watchers, 208)                 \
    S(OrbiteDrainResult, 32)                      \
    F(OrbiteDrainResult, size, 0)                 \
    F(OrbiteDrainResult, version, 4)              \
    F(OrbiteDrainResult, count, 8)                \
    F(OrbiteDrainResult, written, 16)             \
    F(OrbiteDrainResult, next_needed, 24)         \
    S(OrbiteNotifView, 48)                        \
    F(OrbiteNotifView, size, 0)                   \
    F(OrbiteNotifView, version, 4)                \
    F(OrbiteNotifView, sender_epoch, 8)           \
    F(OrbiteNotifView, sender, 16)                \
    F(OrbiteNotifView, sender_len, 24)            \
    F(OrbiteNotifView, payload, 32)               \
    F(OrbiteNotifView, payload_len, 40)

/* Compile time: sizes and offsets, and every record is 8-aligned. */
#define ASSERT_SIZE(T, n)                                     \
    _Static_assert(sizeof(T) == (n), "sizeof(" #T ") == " #n); \
    _Static_assert(alignof(T) == 8, "alignof(" #T ") == 8");
#define ASSERT_FIELD(T, f, n) _Static_assert(offsetof(T, f) == (n), "offsetof(" #T ", " #f ") == " #n);
LAYOUT(ASSERT_SIZE, ASSERT_FIELD)

/* The same numbers at run time, for the comparison with layout.expected. */
struct row {
    const char *key; /* "Record size" or "Record.field" */
    size_t actual;   /* sizeof / offsetof */
    size_t literal;  /* the hand-computed number */
    int seen;
};
#define ROW_SIZE(T, n) { #T " size", sizeof(T), (n), 0 },
#define ROW_FIELD(T, f, n) { #T "." #f, offsetof(T, f), (n), 0 },
static struct row rows[] = { LAYOUT(ROW_SIZE, ROW_FIELD) };
#define NROWS (sizeof rows / sizeof rows[0])

/* Every line of layout.expected names a row with the same number, and every
 * row is named exactly once. */
static void check_expected_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        exit(1);
    }
    char line[256];
    int lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        CHECK(n > 0 && line[n - 1] == '\n');
        line[--n] = '\0';
        char *sp = strrchr(line, ' ');
        if (!sp) {
            fprintf(stderr, "%s:%d: no number: \"%s\"\n", path, lineno, line);
            exit(1);
        }
        *sp = '\0';
        char *end = NULL;
        unsigned long value = strtoul(sp + 1, &end, 10);
        CHECK(end && *end == '\0' && end != sp + 1);
        struct row *r = NULL;
        for (size_t i = 0; i < NROWS; i++) {
            if (strcmp(rows[i].key, line) == 0) {
                r = &rows[i];
            }
        }
        if (!r) {
            fprintf(stderr, "%s:%d: \"%s\" is not a record or field of the header\n", path, lineno, line);
            exit(1);
        }
        if (r->seen++) {
            fprintf(stderr, "%s:%d: \"%s\" appears twice\n", path, lineno, line);
            exit(1);
        }
        if (value != r->literal || value != r->actual) {
            fprintf(stderr, "%s:%d: %s is %lu in the file, %zu here (C says %zu)\n", path, lineno, line, value,
                    r->literal, r->actual);
            exit(1);
        }
    }
    CHECK(!ferror(f));
    fclose(f);
    for (size_t i = 0; i < NROWS; i++) {
        if (!rows[i].seen) {
            fprintf(stderr, "%s: \"%s\" is missing\n", path, rows[i].key);
            exit(1);
        }
    }
    printf("layout.expected: %zu lines match\n", NROWS);
}

static void check_abi_info(void) {
    OrbiteAbiInfo info;
    memset(&info, 0xEE, sizeof info);
    info.size = sizeof info;
    info.version = ORBITE_RECORD_VERSION;
    OK(orbite_abi_info(&info));
    CHECK_EQ_U64(info.size, sizeof(OrbiteAbiInfo));
    CHECK_EQ_U64(info.version, ORBITE_RECORD_VERSION);
    CHECK_EQ_U64(info.abi_major, ORBITE_ABI_MAJOR);
    CHECK((int64_t)info.abi_minor >= (int64_t)ORBITE_ABI_MINOR); /* additions only */
    CHECK_EQ_U64(info.engine_options_size, sizeof(OrbiteEngineOptions));
    CHECK_EQ_U64(info.mem_region_size, sizeof(OrbiteMemRegion));
    CHECK_EQ_U64(info.desc_size, sizeof(OrbiteDesc));
    CHECK_EQ_U64(info.xfer_spec_size, sizeof(OrbiteXferSpec));
    CHECK_EQ_U64(info.xfer_state_size, sizeof(OrbiteXferState));
    CHECK_EQ_U64(info.remote_range_size, sizeof(OrbiteRemoteRange));
    CHECK_EQ_U64(info.close_report_size, sizeof(OrbiteCloseReport));
    CHECK_EQ_U64(info.stats_size, sizeof(OrbiteStats));
    CHECK_EQ_U64(info.drain_result_size, sizeof(OrbiteDrainResult));
    CHECK_EQ_U64(info.notif_view_size, sizeof(OrbiteNotifView));
    uint64_t base = (uint64_t)ORBITE_FEATURE_TCP | (uint64_t)ORBITE_FEATURE_SHM | (uint64_t)ORBITE_FEATURE_CMA |
                    (uint64_t)ORBITE_FEATURE_NOTIFICATIONS | (uint64_t)ORBITE_FEATURE_FILES;
    CHECK((info.features & base) == base);
    CHECK((info.features & ~(base | ORBITE_FEATURE_TEST_HOOKS)) == 0);
    printf("abi %u.%u, features %#" PRIx64 ", every record size agrees\n", info.abi_major, info.abi_minor,
           info.features);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s path/to/layout.expected\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < NROWS; i++) {
        CHECK(rows[i].actual == rows[i].literal);
    }
    check_expected_file(argv[1]);
    check_abi_info();
    printf("layout: ok\n");
    return 0;
}
