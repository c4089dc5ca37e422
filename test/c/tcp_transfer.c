/* Two processes over TCP. This program re-executes itself as the target
 * (`tcp_transfer target`) before any engine exists. The target listens on
 * 127.0.0.1, registers a patterned buffer and hands its peer information
 * and range metadata to the initiator through a pipe. The initiator WRITEs
 * a fragmented pattern with a binary notification (route forced to tcp),
 * asks the target to check the hash of its buffer and the notification,
 * READs the range back, tears down, and tells the target to quit.
 *
 * Protocol (lines): target -> "peer <hex>", "range <hex>"; initiator ->
 * "check <fnv1a hex>", answered "ok|bad <count> <sender_len> <payload hex|->";
 * initiator -> "quit", answered "bye" once the target released everything. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

#define TARGET_LEN ((1u << 20) + 777u) /* the target's registered range */
#define TOTAL 800001u                  /* bytes the initiator writes into it */
#define LOCAL_LEN ((1u << 20) + 4096u)

/* The WRITE: fragments of the initiator's buffer, onto fragments (with gaps)
 * of the target's range; last lengths are computed to cover TOTAL. */
static struct frag w_local[] = { { 5, 70001 }, { 70100, 3 }, { 70200, 400000 }, { 470201, 0 } };
static struct frag w_remote[] = { { 1, 12345 }, { 20000, 300000 }, { 320001, 1 }, { 320003, 65536 }, { 390000, 0 } };
/* The READ of the whole target range, into a second buffer. */
static struct frag r_local[] = { { 0, 333333 }, { 333400, 1 }, { 333402, 0 } };
static struct frag r_remote[] = { { 0, 100000 }, { 100000, 500001 }, { 600001, 0 } };
#define N(a) (sizeof(a) / sizeof((a)[0]))

static const uint8_t payload[] = { 0x00, 'w', 'r', 'o', 't', 'e', 0xFF, 0x00, 0x80, 0x7F, 0xFF, 0xFF, 0x00 };

static void complete(struct frag *f, size_t n, uint64_t total, uint64_t reg_len) {
    uint64_t sum = 0, end = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        CHECK(f[i].offset >= end && f[i].len > 0);
        sum += f[i].len;
        end = f[i].offset + f[i].len;
    }
    CHECK(sum < total && f[n - 1].offset >= end);
    f[n - 1].len = total - sum;
    CHECK(f[n - 1].offset + f[n - 1].len <= reg_len);
}

static uint8_t target_pattern(size_t i) { return (uint8_t)(i * 7u + (i >> 11) + 0x11u); }
static uint8_t initiator_pattern(size_t i) { return (uint8_t)(i * 13u + (i >> 7) * 3u + 0xC3u); }

static void hex_encode(char *out, const uint8_t *p, size_t n) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = '\0';
}

static int nibble(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decodes `hex` (up to a space, newline or NUL) into a new buffer. */
static uint8_t *hex_decode(const char *hex, size_t *len) {
    size_t n = strcspn(hex, " \n");
    CHECK(n % 2 == 0);
    uint8_t *out = malloc(n / 2 + 1);
    CHECK(out);
    for (size_t i = 0; i < n / 2; i++) {
        int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
        CHECK(hi >= 0 && lo >= 0);
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    *len = n / 2;
    return out;
}

/* Reads one line (without its newline) into a new buffer; NULL at EOF. */
static char *read_line(FILE *f) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, f);
    if (n <= 0) {
        free(line);
        return NULL;
    }
    if (line[n - 1] == '\n') {
        line[n - 1] = '\0';
    }
    return line;
}

/* ---- target ---- */

static int target_main(void) {
    alarm(110); /* never outlive the test */
    setvbuf(stdout, NULL, _IOLBF, 0);
    uint8_t *buf = malloc(TARGET_LEN);
    CHECK(buf);
    for (size_t i = 0; i < TARGET_LEN; i++) {
        buf[i] = target_pattern(i);
    }
    OrbiteEngine e = create_engine("{\"listen\":\"127.0.0.1:0\"}");
    /* A listening engine's baseline is not all zero: it allocates its
     * notification inbox (one shared block) when it starts. */
    OrbiteStats base = engine_stats(e);
    print_stats("target baseline", &base);
    CHECK(base.registrations == 0 && base.registered_bytes == 0 && base.fenced_registrations == 0 &&
          base.prepared_transfers == 0 && base.executions == 0 && base.queued_executions == 0 &&
          base.bytes_in_flight == 0 && base.tasks_in_flight == 0 && base.unquiesced_owners == 0 &&
          base.notification_bytes == 0 && base.binding_handles == 0);
    CHECK(base.host_allocations <= 1);
    OrbiteMemRegion r = REC(OrbiteMemRegion);
    r.addr = (uint64_t)(uintptr_t)buf;
    r.len = TARGET_LEN;
    r.kind = ORBITE_MEM_DRAM;
    r.permission = ORBITE_PERM_REMOTE_READ_WRITE;
    OrbiteRegistration reg = { 0 };
    OK(orbite_mem_register(e, &r, &reg));

    size_t n = 0;
    EXPECT_STATUS(orbite_engine_export_peer(e, NULL, 0, &n), ORBITE_STATUS_BUFFER_TOO_SMALL);
    uint8_t *info = malloc(n);
    char *hex = malloc(2 * n + 1);
    CHECK(info && hex);
    OK(orbite_engine_export_peer(e, info, n, &n));
    hex_encode(hex, info, n);
    printf("peer %s\n", hex);
    free(info);
    free(hex);
    EXPECT_STATUS(orbite_mem_export(reg, NULL, 0, &n), ORBITE_STATUS_BUFFER_TOO_SMALL);
    uint8_t *meta = malloc(n);
    hex = malloc(2 * n + 1);
    CHECK(meta && hex);
    OK(orbite_mem_export(reg, meta, n, &n));
    hex_encode(hex, meta, n);
    printf("range %s\n", hex);
    free(meta);
    free(hex);
    fflush(stdout);

    char *line;
    while ((line = read_line(stdin)) != NULL) {
        if (strncmp(line, "check ", 6) == 0) {
            uint64_t want = strtoull(line + 6, NULL, 16);
            uint64_t got = fnv1a(buf, TARGET_LEN);
            uint8_t *nbuf = malloc(1 << 20);
            CHECK(nbuf);
            OrbiteDrainResult dr = REC(OrbiteDrainResult);
            OK(orbite_notifs_drain(e, nbuf, 1 << 20, &dr));
            uint64_t off = 0, sender_len = 0;
            char *phex = NULL;
            OrbiteNotifView v = REC(OrbiteNotifView);
            OrbiteStatus st;
            while ((st = orbite_notif_next(nbuf, dr.written, &off, &v)) == ORBITE_STATUS_OK) {
                free(phex);
                phex = malloc(2 * v.payload_len + 1);
                CHECK(phex);
                hex_encode(phex, v.payload, v.payload_len);
                sender_len = v.sender_len;
            }
            EXPECT_STATUS(st, ORBITE_STATUS_NOT_FOUND);
            printf("%s %" PRIu64 " %" PRIu64 " %s\n", got == want ? "ok" : "bad", dr.count, sender_len,
                   phex && phex[0] ? phex : "-");
            if (got != want) {
                fprintf(stderr, "target: buffer hash %016" PRIx64 ", initiator expects %016" PRIx64 "\n", got, want);
            }
            free(phex);
            free(nbuf);
        } else if (strcmp(line, "quit") == 0) {
            free(line);
            break;
        } else {
            fprintf(stderr, "target: unknown command \"%s\"\n", line);
            free(line);
            return 1;
        }
        free(line);
    }
    OK(orbite_mem_deregister(reg));
    OrbiteStats end = engine_stats(e);
    if (memcmp(&end, &base, sizeof end) != 0) {
        print_stats("target at the end", &end);
        fprintf(stderr, "target: the charges did not return to the baseline\n");
        return 1;
    }
    OrbiteCloseReport rep = REC(OrbiteCloseReport);
    OK(orbite_engine_close(e, 5000, &rep));
    CHECK_EQ_U64(rep.drained, 1);
    OK(orbite_engine_release(e));
    free(buf);
    printf("bye\n");
    return 0;
}

/* ---- initiator ---- */

static OrbiteXferState transfer(OrbiteEngine e, OrbitePeer peer, uint32_t op, const OrbiteDesc *local, size_t nl,
                                const OrbiteDesc *remote, size_t nr, const uint8_t *notif, size_t notif_len,
                                OrbiteXfer *out) {
    OrbiteXferSpec s = REC(OrbiteXferSpec);
    s.op = op;
    s.route = ORBITE_ROUTE_TCP;
    s.flags = notif ? ORBITE_XFER_NOTIFY : 0;
    s.peer = peer;
    s.local = local;
    s.local_count = nl;
    s.remote = remote;
    s.remote_count = nr;
    s.notification = notif;
    s.notification_len = notif_len;
    OK(orbite_xfer_prepare(e, &s, out));
    OK(orbite_xfer_post(*out));
    OrbiteXferState st = wait_retired(*out, 60.0);
    if (st.code != ORBITE_OUTCOME_SUCCESS) {
        fprintf(stderr, "%s: outcome %u, effect %u, %" PRIu64 " of %" PRIu64 " bytes\n",
                op == ORBITE_OP_WRITE ? "WRITE" : "READ", st.code, st.remote_effect, st.transferred_bytes,
                st.total_bytes);
        exit(1);
    }
    CHECK_EQ_U64(st.route, ORBITE_ROUTE_TCP);
    CHECK_EQ_U64(st.drained, 1);
    CHECK_EQ_U64(st.remote_effect, ORBITE_EFFECT_KNOWN);
    CHECK_EQ_U64(st.execution, 1);
    CHECK_EQ_U64(st.tasks_never_started, 0);
    return st;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "target") == 0) {
        return target_main();
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    complete(w_local, N(w_local), TOTAL, LOCAL_LEN);
    complete(w_remote, N(w_remote), TOTAL, TARGET_LEN);
    complete(r_local, N(r_local), TARGET_LEN, LOCAL_LEN);
    complete(r_remote, N(r_remote), TARGET_LEN, TARGET_LEN);

    /* The target first: no engine (and no thread) exists yet. */
    int to_target[2], from_target[2];
    CHECK(pipe(to_target) == 0 && pipe(from_target) == 0);
    const char *self_path = strchr(argv[0], '/') ? argv[0] : "/proc/self/exe";
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        if (dup2(to_target[0], 0) < 0 || dup2(from_target[1], 1) < 0) {
            _exit(126);
        }
        close(to_target[0]);
        close(to_target[1]);
        close(from_target[0]);
        close(from_target[1]);
        char *args[] = { (char *)self_path, (char *)"target", NULL };
        execv(self_path, args);
        _exit(127);
    }
    close(to_target[0]);
    close(from_target[1]);
    signal(SIGPIPE, SIG_IGN);
    FILE *tin = fdopen(to_target[1], "w");
    FILE *tout = fdopen(from_target[0], "r");
    CHECK(tin && tout);
    setvbuf(tin, NULL, _IOLBF, 0);

    char *peer_line = read_line(tout);
    char *range_line = read_line(tout);
    if (!peer_line || !range_line || strncmp(peer_line, "peer ", 5) != 0 || strncmp(range_line, "range ", 6) != 0) {
        fprintf(stderr, "initiator: the target did not describe itself\n");
        return 1;
    }
    size_t info_len = 0, meta_len = 0;
    uint8_t *info = hex_decode(peer_line + 5, &info_len);
    uint8_t *meta = hex_decode(range_line + 6, &meta_len);
    free(peer_line);
    free(range_line);

    uint8_t *local = malloc(LOCAL_LEN), *back = malloc(LOCAL_LEN), *want = malloc(TARGET_LEN);
    CHECK(local && back && want);
    for (size_t i = 0; i < LOCAL_LEN; i++) {
        local[i] = initiator_pattern(i);
    }
    memset(back, 0xEE, LOCAL_LEN);

    OrbiteEngine e = create_engine("{}");
    OrbiteMemRegion r = REC(OrbiteMemRegion);
    r.kind = ORBITE_MEM_DRAM;
    r.permission = ORBITE_PERM_LOCAL_ONLY;
    r.addr = (uint64_t)(uintptr_t)local;
    r.len = LOCAL_LEN;
    OrbiteRegistration rl = { 0 }, rb = { 0 };
    OK(orbite_mem_register(e, &r, &rl));
    r.addr = (uint64_t)(uintptr_t)back;
    OK(orbite_mem_register(e, &r, &rb));

    OrbitePeer peer = { 0 };
    OK(orbite_peer_open(e, info, info_len, 10000, &peer));
    OrbiteRemoteRange rr = REC(OrbiteRemoteRange);
    OK(orbite_peer_import_range(peer, meta, meta_len, &rr));
    free(info);
    free(meta);
    CHECK_EQ_U64(rr.len, TARGET_LEN);
    CHECK_EQ_U64(rr.permission, ORBITE_PERM_REMOTE_READ_WRITE);
    CHECK_EQ_U64(rr.shared, 0);

    /* WRITE, with the notification. */
    OrbiteDesc wl[N(w_local)], wr[N(w_remote)];
    descs(wl, w_local, N(w_local), rl.raw);
    descs(wr, w_remote, N(w_remote), rr.remote_registration);
    OrbiteXfer xw = { 0 };
    OrbiteXferState st = transfer(e, peer, ORBITE_OP_WRITE, wl, N(wl), wr, N(wr), payload, sizeof payload, &xw);
    CHECK_EQ_U64(st.transferred_prefix, TOTAL);
    printf("WRITE over tcp: %u bytes, %u tasks\n", TOTAL, st.tasks_started);

    for (size_t i = 0; i < TARGET_LEN; i++) {
        want[i] = target_pattern(i);
    }
    apply(want, w_remote, N(w_remote), local, w_local, N(w_local));
    fprintf(tin, "check %016" PRIx64 "\n", fnv1a(want, TARGET_LEN));
    char *answer = read_line(tout);
    CHECK(answer);
    char payload_hex[2 * sizeof payload + 1];
    hex_encode(payload_hex, payload, sizeof payload);
    char expect[256];
    snprintf(expect, sizeof expect, "ok 1 0 %s", payload_hex);
    if (strcmp(answer, expect) != 0) {
        fprintf(stderr, "initiator: the target answered \"%s\", expected \"%s\"\n", answer, expect);
        return 1;
    }
    printf("target: hash and notification match (%s)\n", answer);
    free(answer);

    /* READ the whole range back. */
    OrbiteDesc bl[N(r_local)], br[N(r_remote)];
    descs(bl, r_local, N(r_local), rb.raw);
    descs(br, r_remote, N(r_remote), rr.remote_registration);
    OrbiteXfer xr = { 0 };
    st = transfer(e, peer, ORBITE_OP_READ, bl, N(bl), br, N(br), NULL, 0, &xr);
    CHECK_EQ_U64(st.transferred_prefix, TARGET_LEN);
    uint8_t *want_back = malloc(LOCAL_LEN);
    CHECK(want_back);
    memset(want_back, 0xEE, LOCAL_LEN);
    apply(want_back, r_local, N(r_local), want, r_remote, N(r_remote));
    for (size_t i = 0; i < LOCAL_LEN; i++) {
        if (back[i] != want_back[i]) {
            fprintf(stderr, "READ: byte %zu is %#x, expected %#x\n", i, back[i], want_back[i]);
            return 1;
        }
    }
    printf("READ over tcp: %u bytes, %u tasks, match\n", TARGET_LEN, st.tasks_started);
    free(want_back);

    OK(orbite_xfer_release(xw));
    OK(orbite_xfer_release(xr));
    OK(orbite_mem_deregister(rl));
    OK(orbite_mem_deregister(rb));
    OK(orbite_peer_close(peer, 5000));
    check_stats_zero(e, "initiator after teardown");
    OrbiteCloseReport rep = REC(OrbiteCloseReport);
    OK(orbite_engine_close(e, 5000, &rep));
    CHECK_EQ_U64(rep.drained, 1);
    OK(orbite_engine_release(e));

    fprintf(tin, "quit\n");
    answer = read_line(tout);
    if (!answer || strcmp(answer, "bye") != 0) {
        fprintf(stderr, "initiator: the target answered \"%s\" to quit\n", answer ? answer : "(EOF)");
        return 1;
    }
    free(answer);
    fclose(tin);
    fclose(tout);
    int status = 0;
    pid_t w;
    while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    CHECK(w == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "target: %s %d\n", WIFEXITED(status) ? "exit status" : "killed by signal",
                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        return 1;
    }
    free(local);
    free(back);
    free(want);
    printf("tcp_transfer: ok\n");
    return 0;
}
