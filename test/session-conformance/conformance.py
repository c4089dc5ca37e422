#!/usr/bin/env python3
"""Black-box conformance suite of the OrbiTE KV-session gRPC service
(proto/orbite/kv/v1/kv_session.proto, semantics of docs/api.md).

    conformance.py ADDR [--orbite BIN] [--only SUBSTR ...] [--proto DIR]

Prints one line per case (`ok NAME`, `FAIL NAME: why`, `SKIP NAME: why`)
and ends with `session conformance: N passed, M failed`; exits 0 iff M is 0.
Cases run in order; the drain case runs last because it makes ADDR refuse
new sessions for good.
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvconf  # noqa: E402
from kvconf import ABSENT, Failure, check, eq, expect_err, poll_until, short  # noqa: E402

SC = grpc.StatusCode
pb = None  # set in main() once the stubs exist

# Enum values, by the proto's numbering.
UNSPEC, CF, GF, CONC = 0, 1, 2, 3
REQUIRED, BYPASS = 1, 2
S = {}  # state name -> value, filled in main()


class Skip(Exception):
    pass


# ---------------------------------------------------------------- registry

CASES = []


class Case:
    def __init__(self, name, fn, last=False, orbite=False):
        self.name, self.fn, self.last, self.orbite = name, fn, last, orbite


def case(name, last=False, orbite=False):
    def deco(fn):
        CASES.append(Case(name, fn, last, orbite))
        return fn
    return deco


# ---------------------------------------------------------------- context

class Ctx:
    """What a case gets: the address, the advertised info, the KV regions,
    clients whose sessions are tracked for cleanup, unique keys and soft
    checks."""

    def __init__(self, addr, orbite, stub_dir, nonce):
        self.addr = addr
        self.orbite = orbite
        self.stub_dir = stub_dir
        self.nonce = nonce
        self.created = set()
        self.clients = []
        self.soft_failures = []
        self.notes = []
        self.n = 0
        self.case_name = ""
        self.admin = kvconf.Client(addr)
        self.info = self.admin.info()
        self.limits = self.info.limits
        self.inc = self.info.incarnation
        st = self.admin.stats()
        self.regions = list(st.kv_regions)

    # -- per case
    def begin(self, name):
        self.case_name = name
        self.created = set()
        self.clients = []
        self.soft_failures = []
        self.notes = []

    def end(self):
        for c in self.clients:
            c.close()
        self.clients = []

    def client(self, addr=None):
        c = kvconf.Client(addr or self.addr, tracker=self.created)
        self.clients.append(c)
        return c

    def key(self, tag="k"):
        self.n += 1
        return f"conf-{self.nonce}-{self.case_name}-{tag}-{self.n}"

    def stats(self):
        return self.admin.stats()

    def note(self, text):
        self.notes.append(text)

    # -- soft checks: a sub-check's failure is recorded, the case goes on
    def sub(self, label):
        ctx = self

        class _Sub:
            def __enter__(self):
                return self

            def __exit__(self, et, ev, tb):
                if et is None:
                    return False
                if issubclass(et, Failure):
                    ctx.soft_failures.append(f"{label}: {ev}")
                    return True
                if issubclass(et, grpc.RpcError):
                    ctx.soft_failures.append(f"{label}: unexpected {kvconf.Refusal(ev).describe()}")
                    return True
                return False
        return _Sub()

    # -- KV ranges from the server's regions
    def region(self):
        check(self.regions, "GetKvSessionStats lists no kv_regions: no KV to mark ready")
        return max(self.regions, key=lambda r: r.len)

    def ranges(self, n=1, slot=0, size=None, region=None):
        """n contiguous ranges of one registration that together hold
        `size` bytes (the default KV size), placed at slot `slot`."""
        reg = region or self.region()
        size = size if size is not None else kvconf.kv_size()
        check(size <= reg.len, f"KV region of {reg.len} bytes is smaller than {size}")
        room = reg.len - size
        base = reg.offset + ((slot * size) % (room + 1) if room else 0)
        out, off = [], base
        for i in range(n):
            ln = size // n + (1 if i < size % n else 0)
            out.append(pb.KvRange(registration=reg.registration, offset=off, len=ln))
            off += ln
        return out


# ---------------------------------------------------------------- helpers

def snapshot(ctx):
    s = ctx.stats()
    return s


def assert_unchanged(ctx, before, sessions=(), client=None, what=""):
    """Nothing changed: stats live/pinned/tracked and every session in
    `sessions` (KvSession messages taken before) equal."""
    after = ctx.stats()
    label = f"{what}: " if what else ""
    eq(after.live_sessions, before.live_sessions, f"{label}live_sessions after a refusal")
    eq(after.pinned_ranges, before.pinned_ranges, f"{label}pinned_ranges after a refusal")
    eq(after.tracked_transfers, before.tracked_transfers, f"{label}tracked_transfers after a refusal")
    check(after.tombstones <= before.tombstones,
          f"{label}tombstones grew after a refusal: {before.tombstones} -> {after.tombstones}")
    c = client or ctx.admin
    for s in sessions:
        now = c.get(s.session_id)
        if now != s:
            raise Failure(f"{label}session {s.session_id} changed by a refusal: "
                          f"{short(s)} -> {short(now)}")


def refused(ctx, fn, code, reason, meta=None, sessions=(), what=""):
    """fn is refused with code/reason and nothing changes."""
    before = ctx.stats()
    snap = [ctx.admin.get(s.session_id) for s in sessions]
    r = expect_err(fn, code, reason, meta, what)
    assert_unchanged(ctx, before, snap, what=what)
    return r


def state_is(s, want, what="state"):
    if s.state != want:
        raise Failure(f"{what}: {kvconf.state_name(s.state)}, want {kvconf.state_name(want)} "
                      f"({short(s)})")


def lease_near(s, lease_ms, t0, t1, what="lease_expires_at", slack=400):
    check(s.HasField("lease_expires_at"), f"{what}: absent")
    exp = kvconf.ts_ms(s.lease_expires_at)
    lo, hi = t0 + lease_ms - slack, t1 + lease_ms + slack
    check(lo <= exp <= hi, f"{what}: {exp:.0f} ms is not now+{lease_ms} ms "
                           f"(window {lo:.0f}..{hi:.0f}, off by {exp - (t0 + t1) / 2 - lease_ms:+.0f} ms)")


def pinned_back(ctx, want=0, timeout=2.0):
    st = poll_until(lambda: (lambda s: s if s.pinned_ranges == want else None)(ctx.stats()), timeout)
    if not st:
        raise Failure(f"pinned_ranges stays {ctx.stats().pinned_ranges}, want {want} within {timeout}s")


def pinned_is(ctx, want, what=""):
    eq(ctx.stats().pinned_ranges, want, f"{what} pinned_ranges".strip())


def meta_of(s):
    return pb.KvTransferMeta(layout=s.meta.layout, block_bytes=s.meta.block_bytes, blocks=s.meta.blocks)


def ended_meta(sid, state):
    return {"session_id": sid, "state": lambda v: kvconf.norm_state(v) == kvconf.norm_state(
        pb.KvSessionState.Name(state))}


def no_reason(s, what):
    check(not s.HasField("reason"), f"{what}: reason {s.reason!r}, want none")


def supported(ctx, style):
    return style in ctx.info.supported_styles


def need_style(ctx, style):
    if not supported(ctx, style):
        raise Skip(f"{pb.KvScheduleStyle.Name(style)} is not in supported_styles")


def fresh_ready(ctx, c, style=CF, disposition=REQUIRED, lease_ms=ABSENT, n=1, slot=0):
    s = c.allocate(ctx.key(), style=style, disposition=disposition, lease_ms=lease_ms)
    rg = ctx.ranges(n, slot)
    r = c.ready(s.session_id, rg)
    state_is(r, S["READY"], "mark ready")
    return r, rg


def wait_state(c, sid, state, timeout=2.5):
    got = poll_until(lambda: (lambda s: s if s.state == state else None)(c.get(sid)), timeout)
    if not got:
        s = c.get(sid)
        raise Failure(f"{sid} stays {kvconf.state_name(s.state)}, want {kvconf.state_name(state)} "
                      f"within {timeout}s")
    return got


# ================================================================ cases

@case("info.capabilities")
def info_capabilities(ctx):
    i = ctx.info
    eq(i.schema_version, 1, "schema_version")
    check(kvconf.ID_RE.match(f"{i.incarnation}-1") is not None,
          f"incarnation {i.incarnation!r} is not 16 lowercase hex digits")
    st = ctx.stats()
    eq(st.incarnation, i.incarnation, "stats.incarnation vs info.incarnation")
    check(st.kv_regions, "stats.kv_regions is empty: no KV a producer could mark ready")
    for r in st.kv_regions:
        check(r.offset == 0 and r.len > 0, f"kv_region {short(r)}: want a whole registration (offset 0, len > 0)")
    eq(st.draining, False, "stats.draining before any drain")
    for flag in ("caller_allocation", "explicit_release", "session_lookup"):
        check(getattr(i, flag), f"{flag} false, yet the service offers it (allocate/release/get are RPCs)")
    check(i.supported_styles, "supported_styles is empty")
    for s in i.supported_styles:
        check(s in (CF, GF, CONC), f"supported_styles lists {s}")
    check(i.default_style in (CF, GF, CONC), f"default_style {i.default_style}")
    L = i.limits
    check(0 < L.default_lease_ms <= L.max_lease_ms,
          f"default_lease_ms {L.default_lease_ms} / max_lease_ms {L.max_lease_ms}")
    for f in ("max_live_sessions", "max_field_bytes", "max_ranges", "max_message_bytes", "max_tombstones"):
        check(getattr(L, f) > 0, f"limits.{f} is 0")
    c = ctx.client()
    # Ids: prefix is the incarnation, sequences grow.
    a = c.allocate(ctx.key())
    b = c.allocate(ctx.key())
    for s in (a, b):
        m = kvconf.ID_RE.match(s.session_id)
        check(m is not None, f"session id {s.session_id!r} is not '<16 hex>-<decimal>'")
        eq(m.group(1), i.incarnation, "session id prefix")
        eq(s.rendezvous.session_id, s.session_id, "rendezvous.session_id")
        eq(s.rendezvous.endpoint, i.endpoint, "rendezvous.endpoint vs info.endpoint")
        eq(s.rendezvous.epoch, i.epoch, "rendezvous.epoch vs info.epoch")
    check(int(b.session_id.split("-")[1]) > int(a.session_id.split("-")[1]),
          f"ids do not grow: {a.session_id} then {b.session_id}")
    # Every style: a supported one allocates, another is refused.
    for style in (CF, GF, CONC):
        name = pb.KvScheduleStyle.Name(style)
        with ctx.sub(f"style {name}"):
            if supported(ctx, style):
                s = c.allocate(ctx.key(), style=style)
                eq(s.style, style, "style")
                eq(s.effective_style, style, "effective_style")
            else:
                refused(ctx, lambda: c.allocate(ctx.key(), style=style), SC.FAILED_PRECONDITION,
                        "UNSUPPORTED_STYLE", {"style": None}, what=f"allocate {name}")
    # Unspecified: stays unspecified, the default applies.
    s = c.allocate(ctx.key(), style=UNSPEC)
    eq(s.style, UNSPEC, "style of an UNSPECIFIED request")
    eq(s.effective_style, i.default_style, "effective_style of an UNSPECIFIED request")
    at = refusal_or(lambda: c.attach(s.session_id))
    if i.default_style == CF:
        check(at is not None and at.reason == "NOT_READY",
              f"attach before ready under default ContextFirst: {at.describe() if at else 'OK'}")
    else:
        check(at is None, f"attach before ready under default {i.default_style}: {at and at.describe()}")
    # Conditional bypass and renewable leases as advertised.
    with ctx.sub("conditional_bypass"):
        if i.conditional_bypass:
            s = c.allocate(ctx.key(), disposition=BYPASS)
            eq(s.disposition, BYPASS, "disposition")
        else:
            refused(ctx, lambda: c.allocate(ctx.key(), disposition=BYPASS), SC.FAILED_PRECONDITION,
                    "BYPASS_NOT_SUPPORTED")
    with ctx.sub("renewable_leases"):
        s = c.allocate(ctx.key())
        if i.renewable_leases:
            c.renew(s.session_id, 1000)
        else:
            refused(ctx, lambda: c.renew(s.session_id, 1000), SC.FAILED_PRECONDITION, "WRONG_STATE",
                    sessions=[s])
    with ctx.sub("local_prefill"):
        r = refusal_or(lambda: c.sessionless(REQUIRED))
        if i.local_prefill:
            check(r is None, f"local_prefill advertised, CheckSessionlessDecode(REQUIRED): {r and r.describe()}")
        else:
            check(r is not None and r.reason == "SESSION_REQUIRED",
                  f"no local_prefill, CheckSessionlessDecode(REQUIRED): {r.describe() if r else 'OK'}")
    for sid in list(ctx.created):
        c.release(sid)


def refusal_or(fn):
    return kvconf.refusal_of(fn)


# ---------------------------------------------------------------- flows

@case("flow.context_first")
def flow_context_first(ctx):
    need_style(ctx, CF)
    P, C = ctx.client(), ctx.client()
    base_pins = ctx.stats().pinned_ranges
    t0 = kvconf.now_ms()
    s = P.allocate(ctx.key(), style=CF, disposition=REQUIRED)
    t1 = kvconf.now_ms()
    sid = s.session_id
    state_is(s, S["ALLOCATED"], "allocate")
    eq(s.style, CF, "style")
    eq(s.effective_style, CF, "effective_style")
    eq(s.disposition, REQUIRED, "disposition")
    eq(s.consumer_queued, False, "consumer_queued")
    eq(len(s.rendezvous.ranges), 0, "rendezvous ranges before ready")
    eq(s.meta, kvconf.default_meta(), "meta")
    no_reason(s, "allocated session")
    lease_near(s, ctx.limits.default_lease_ms, t0, t1)
    # The consumer is early: not ready is refused and changes nothing.
    refused(ctx, lambda: C.attach(sid), SC.UNAVAILABLE, "NOT_READY", {"session_id": sid}, [s],
            "context-first attach before ready")
    n = 2 if kvconf.kv_size() >= 2 else 1
    rg = ctx.ranges(n)
    r = P.ready(sid, rg)
    state_is(r, S["READY"], "mark ready")
    eq(list(r.rendezvous.ranges), rg, "rendezvous ranges after ready")
    eq(r.rendezvous.session_id, sid, "rendezvous.session_id")
    pinned_is(ctx, base_pins + n, "after mark ready")
    refused(ctx, lambda: P.ready(sid, rg), SC.FAILED_PRECONDITION, "WRONG_STATE",
            {"session_id": sid, "state": None, "op": None}, [r], "mark ready twice")
    refused(ctx, lambda: C.complete(sid), SC.FAILED_PRECONDITION, "WRONG_STATE",
            {"session_id": sid}, [r], "complete before attach")
    a = C.attach(sid)
    eq(a.queued, False, "attach.queued")
    state_is(a.session, S["ATTACHED"], "attach")
    eq(list(a.session.rendezvous.ranges), rg, "attach ranges")
    a2 = C.attach(sid)
    state_is(a2.session, S["ATTACHED"], "attach again")
    state_is(P.get(sid), S["ATTACHED"], "producer's get")
    done = C.complete(sid)
    state_is(done, S["COMPLETE"], "complete")
    no_reason(done, "complete")
    pinned_back(ctx, base_pins)
    rel = P.release(sid)
    eq(rel.released_now, False, "producer release after complete: released_now")
    eq(rel.state, S["COMPLETE"], "producer release after complete: state")
    eq(rel.session_id, sid, "release.session_id")
    state_is(P.get(sid), S["COMPLETE"], "get after release")


@case("flow.generation_first")
def flow_generation_first(ctx):
    need_style(ctx, GF)
    P, C = ctx.client(), ctx.client()
    s = C.allocate(ctx.key(), style=GF, lease_ms=500)
    sid = s.session_id
    eq(len(s.rendezvous.ranges), 0, "rendezvous without ranges")
    a = C.attach(sid)
    eq(a.queued, True, "attach before ready: queued")
    state_is(a.session, S["ALLOCATED"], "queued attach")
    eq(a.session.consumer_queued, True, "consumer_queued after a queued attach")
    # The consumer waits longer than its first lease, renewing.
    first_exp = kvconf.ts_ms(s.lease_expires_at)
    last = first_exp
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        time.sleep(0.12)
        t0 = kvconf.now_ms()
        rn = C.renew(sid, 500)
        t1 = kvconf.now_ms()
        state_is(rn, S["ALLOCATED"], "renew while queued")
        eq(rn.consumer_queued, True, "consumer_queued while renewing")
        lease_near(rn, 500, t0, t1, "renewed lease")
        exp = kvconf.ts_ms(rn.lease_expires_at)
        check(exp >= last, f"renewed expiry went back: {last} -> {exp}")
        last = exp
    check(kvconf.now_ms() > first_exp + 200, "the wait did not outlast the first lease")
    g = P.get(sid)
    state_is(g, S["ALLOCATED"], "producer sees the queued session")
    eq(g.consumer_queued, True, "producer sees consumer_queued")
    rg = ctx.ranges()
    r = P.ready(sid, rg)
    state_is(r, S["READY"], "mark ready")
    a = C.attach(sid)
    eq(a.queued, False, "attach after ready: queued")
    state_is(a.session, S["ATTACHED"], "attach after ready")
    eq(a.session.consumer_queued, False, "consumer_queued cleared by the later attach")
    eq(list(a.session.rendezvous.ranges), rg, "ranges")
    state_is(C.complete(sid), S["COMPLETE"], "complete")
    pinned_back(ctx)
    rel = C.release(sid)
    eq((rel.released_now, rel.state), (False, S["COMPLETE"]), "release after complete")


@case("flow.concurrent")
def flow_concurrent(ctx):
    need_style(ctx, CONC)
    P, C = ctx.client(), ctx.client()
    s = C.allocate(ctx.key(), style=CONC, lease_ms=2000)
    sid = s.session_id
    a = C.attach(sid)
    eq(a.queued, True, "first attach: queued (not a failure)")
    eq(a.session.consumer_queued, True, "consumer_queued")
    rg = ctx.ranges()
    errs = []

    def producer():
        try:
            time.sleep(0.15)
            P.ready(sid, rg)
        except Exception as e:  # reported below
            errs.append(e)
    t = threading.Thread(target=producer)
    t.start()
    attached = None
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        a = C.attach(sid)
        if not a.queued:
            attached = a
            break
        C.renew(sid, 2000)
        time.sleep(0.03)
    t.join()
    check(not errs, f"producer's mark ready failed: {errs}")
    check(attached is not None, "the consumer never attached")
    state_is(attached.session, S["ATTACHED"], "attach")
    eq(list(attached.session.rendezvous.ranges), rg, "ranges")
    state_is(C.complete(sid), S["COMPLETE"], "complete")
    pinned_back(ctx)
    rel = P.release(sid)
    eq((rel.released_now, rel.state), (False, S["COMPLETE"]), "producer release after complete")


@case("flow.conditional_bypass")
def flow_conditional_bypass(ctx):
    if not ctx.info.conditional_bypass:
        raise Skip("conditional_bypass is not advertised")
    style = CONC if supported(ctx, CONC) else ctx.info.supported_styles[0]
    P, C = ctx.client(), ctx.client()
    base = ctx.stats()
    # a. the consumer has enough local state
    with ctx.sub("bypass before ready"):
        s = C.allocate(ctx.key(), style=style, disposition=BYPASS)
        b = C.bypass(s.session_id)
        state_is(b, S["BYPASSED"], "bypass")
        no_reason(b, "bypassed")
        refused(ctx, lambda: P.ready(s.session_id, ctx.ranges()), SC.FAILED_PRECONDITION,
                "SESSION_ENDED", ended_meta(s.session_id, S["BYPASSED"]), [b], "mark ready after bypass")
        pinned_is(ctx, base.pinned_ranges, "after a refused mark ready")
    # b. it has not: queued, then the concurrent flow
    with ctx.sub("bypass disposition, then attach"):
        s = C.allocate(ctx.key(), style=style, disposition=BYPASS)
        if style != CF:
            eq(C.attach(s.session_id).queued, True, "attach before ready queued")
        P.ready(s.session_id, ctx.ranges())
        a = C.attach(s.session_id)
        state_is(a.session, S["ATTACHED"], "attach")
        state_is(C.complete(s.session_id), S["COMPLETE"], "complete")
    # c. it cannot wait: a clean Failed
    with ctx.sub("bypass disposition, queued, fail"):
        s = C.allocate(ctx.key(), style=style, disposition=BYPASS)
        if style != CF:
            C.attach(s.session_id)
        f = C.fail(s.session_id, "cannot wait")
        state_is(f, S["FAILED"], "fail")
        eq(f.reason, "cannot wait", "reason")
        eq(f.consumer_queued, False, "consumer_queued cleared when the session ends")
    # d. bypass after the KV is pinned frees it
    with ctx.sub("bypass after ready"):
        s = C.allocate(ctx.key(), style=style, disposition=BYPASS)
        P.ready(s.session_id, ctx.ranges())
        state_is(C.bypass(s.session_id), S["BYPASSED"], "bypass after ready")
        pinned_back(ctx, base.pinned_ranges)
    # e. no bypass on a session that requires the KV
    with ctx.sub("bypass of a REQUIRED session"):
        s = C.allocate(ctx.key(), style=style, disposition=REQUIRED)
        refused(ctx, lambda: C.bypass(s.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": s.session_id}, [s], "bypass without disposition BYPASS")
        s2 = C.allocate(ctx.key(), style=style, disposition=UNSPEC)
        refused(ctx, lambda: C.bypass(s2.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": s2.session_id}, [s2], "bypass with disposition UNSPECIFIED (= REQUIRED)")
    # f. a decode with no session at all
    with ctx.sub("sessionless decode"):
        C.sessionless(BYPASS)
        if not ctx.info.local_prefill:
            refused(ctx, lambda: C.sessionless(REQUIRED), SC.FAILED_PRECONDITION, "SESSION_REQUIRED")
    for sid in list(ctx.created):
        C.release(sid)


@case("flow.reject_and_fail")
def flow_reject_and_fail(ctx):
    P, C = ctx.client(), ctx.client()
    style = ctx.info.supported_styles[0]
    base = ctx.stats().pinned_ranges
    with ctx.sub("consumer rejects after the KV is pinned"):
        r, _ = fresh_ready(ctx, P, style=style)
        sid = r.session_id
        pinned_is(ctx, base + 1, "after ready")
        j = C.reject(sid, "decode refused admission")
        state_is(j, S["REJECTED"], "reject")
        eq(j.reason, "decode refused admission", "reason")
        pinned_back(ctx, base)
        g = P.get(sid)
        state_is(g, S["REJECTED"], "producer's get (tombstone)")
        eq(g.reason, "decode refused admission", "tombstone reason")
        rel = P.release(sid)
        eq((rel.released_now, rel.state, rel.reason), (False, S["REJECTED"], "decode refused admission"),
           "producer release of the rejected session")
    with ctx.sub("producer rejects before ready"):
        s = P.allocate(ctx.key(), style=style)
        j = P.reject(s.session_id, "prefill refused")
        state_is(j, S["REJECTED"], "reject")
        eq(j.reason, "prefill refused", "reason")
    with ctx.sub("producer rejects after ready"):
        r, _ = fresh_ready(ctx, P, style=style)
        state_is(P.reject(r.session_id, "producer changed its mind"), S["REJECTED"], "reject")
        pinned_back(ctx, base)
    with ctx.sub("consumer fails after attach"):
        r, _ = fresh_ready(ctx, P, style=style)
        C.attach(r.session_id)
        f = C.fail(r.session_id, "READ failed: peer lost")
        state_is(f, S["FAILED"], "fail")
        eq(f.reason, "READ failed: peer lost", "reason")
        pinned_back(ctx, base)
        state_is(P.get(r.session_id), S["FAILED"], "producer sees FAILED")
    with ctx.sub("producer fails after ready"):
        r, _ = fresh_ready(ctx, P, style=style)
        f = P.fail(r.session_id, "prefill crashed")
        state_is(f, S["FAILED"], "fail")
        pinned_back(ctx, base)
        refused(ctx, lambda: C.attach(r.session_id), SC.FAILED_PRECONDITION, "SESSION_ENDED",
                ended_meta(r.session_id, S["FAILED"]), [f], "attach after fail")
    with ctx.sub("producer fails before ready"):
        s = P.allocate(ctx.key(), style=style)
        state_is(P.fail(s.session_id, "no KV"), S["FAILED"], "fail")


@case("release.abort_orders")
def release_abort_orders(ctx):
    P, C = ctx.client(), ctx.client()
    base = ctx.stats().pinned_ranges
    with ctx.sub("abort then release"):
        r, _ = fresh_ready(ctx, P)
        ab = C.abort(r.session_id)
        state_is(ab, S["CANCELLED"], "abort")
        eq(ab.reason, "aborted", "reason of CANCELLED")
        pinned_back(ctx, base)
        rel = P.release(r.session_id)
        eq((rel.released_now, rel.state, rel.reason), (False, S["CANCELLED"], "aborted"),
           "release after abort")
        ab2 = C.abort(r.session_id)
        eq(ab2, P.get(r.session_id), "abort again returns the session unchanged")
        state_is(ab2, S["CANCELLED"], "abort again")
    with ctx.sub("release then abort"):
        r, _ = fresh_ready(ctx, P)
        rel = P.release(r.session_id)
        eq((rel.released_now, rel.state), (True, S["RELEASED"]), "release")
        check(not rel.HasField("reason"), f"release: reason {rel.reason!r}, want none")
        pinned_back(ctx, base)
        ab = C.abort(r.session_id)
        state_is(ab, S["RELEASED"], "abort after release")
        rel2 = P.release(r.session_id)
        eq((rel2.released_now, rel2.state), (False, S["RELEASED"]), "release again")
    with ctx.sub("release of an allocated session"):
        s = P.allocate(ctx.key())
        rel = P.release(s.session_id)
        eq((rel.released_now, rel.state), (True, S["RELEASED"]), "release")
    with ctx.sub("abort of an attached session"):
        r, _ = fresh_ready(ctx, P)
        C.attach(r.session_id)
        state_is(C.abort(r.session_id), S["CANCELLED"], "abort")
        pinned_back(ctx, base)


# ---------------------------------------------------------------- validation

@case("validate.allocate_missing")
def validate_allocate_missing(ctx):
    c = ctx.client()
    for field in ("request_id", "model", "idempotency_key"):
        with ctx.sub(field):
            key = ctx.key()
            req = c.allocate_req(key)
            setattr(req, field, "")
            refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "MISSING_FIELD",
                    {"field": field}, what=f"allocate without {field}")
    with ctx.sub("meta"):
        req = c.allocate_req(ctx.key(), no_meta=True)
        refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "MISSING_FIELD",
                {"field": "meta"}, what="allocate without meta")
    with ctx.sub("meta.layout"):
        key = ctx.key()
        req = c.allocate_req(key, meta=kvconf.default_meta(layout=""))
        refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "MISSING_FIELD",
                {"field": "meta.layout"}, what="allocate with an empty layout")
        # Nothing was allocated: the key is still free.
        s = c.allocate(key)
        state_is(s, S["ALLOCATED"], "the same key, valid, afterwards")
        c.release(s.session_id)


@case("validate.allocate_too_long")
def validate_allocate_too_long(ctx):
    c = ctx.client()
    mx = ctx.limits.max_field_bytes
    if mx > 1 << 20:
        raise Skip(f"max_field_bytes {mx} is too large to probe")
    for field in ("request_id", "model", "idempotency_key", "meta.layout"):
        with ctx.sub(field):
            key = ctx.key()
            long_ = ("x" * (mx + 1))
            exact = ("y" * mx)
            if field == "meta.layout":
                req = c.allocate_req(key, meta=kvconf.default_meta(layout=long_))
                ok_req = c.allocate_req(ctx.key(), meta=kvconf.default_meta(layout=exact))
            else:
                req = c.allocate_req(key)
                setattr(req, field, long_)
                ok_req = c.allocate_req(ctx.key())
                setattr(ok_req, field, exact)
            refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "FIELD_TOO_LONG",
                    {"field": field, "len": mx + 1, "max": mx}, what=f"{field} of {mx + 1} bytes")
            s = c.allocate(req=ok_req)
            state_is(s, S["ALLOCATED"], f"{field} of exactly max_field_bytes ({mx})")
            c.release(s.session_id)
    with ctx.sub("bytes, not characters"):
        # A 2-byte character: max/2 + 1 of them exceed the limit in bytes.
        n = mx // 2 + 1
        req = c.allocate_req(ctx.key(), model="\u00e9" * n)
        refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "FIELD_TOO_LONG",
                {"field": "model", "len": 2 * n}, what=f"model of {n} two-byte characters")


@case("validate.allocate_enums")
def validate_allocate_enums(ctx):
    c = ctx.client()
    for field, val in (("style", 4), ("style", 99), ("style", -1), ("disposition", 3), ("disposition", -7)):
        with ctx.sub(f"{field}={val}"):
            key = ctx.key()
            req = c.allocate_req(key)
            setattr(req, field, val)
            refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "INVALID_VALUE",
                    {"field": field, "value": None}, what=f"allocate {field}={val}")
            s = c.allocate(key)  # nothing was taken
            c.release(s.session_id)
    with ctx.sub("CheckSessionlessDecode disposition=9"):
        refused(ctx, lambda: c.sessionless(9), SC.INVALID_ARGUMENT, "INVALID_VALUE",
                {"field": "disposition"}, what="CheckSessionlessDecode(9)")


@case("validate.allocate_meta_size")
def validate_allocate_meta_size(ctx):
    c = ctx.client()
    for what, meta in (("block_bytes 0", kvconf.default_meta(block_bytes=0)),
                       ("blocks 0", kvconf.default_meta(blocks=0)),
                       ("both 0", kvconf.default_meta(block_bytes=0, blocks=0)),
                       ("size overflows u64", kvconf.default_meta(block_bytes=1 << 63, blocks=2)),
                       ("size overflows u64 (max*max)", kvconf.default_meta(block_bytes=(1 << 64) - 1,
                                                                            blocks=(1 << 64) - 1))):
        with ctx.sub(what):
            req = c.allocate_req(ctx.key(), meta=meta)
            refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "INCOMPATIBLE_METADATA",
                    what=f"allocate with {what}")


@case("validate.allocate_order")
def validate_allocate_order(ctx):
    """docs/api.md: request_id, model, idempotency_key present; style;
    disposition; lease; metadata; then the key; Draining; TooManySessions."""
    c = ctx.client()
    bad_style = 77
    rows = [
        ("request_id before model", dict(request_id="", model=""), "MISSING_FIELD", {"field": "request_id"}),
        ("model before idempotency_key", dict(model="", idempotency_key=""), "MISSING_FIELD", {"field": "model"}),
        ("idempotency_key before style", dict(idempotency_key="", style=bad_style), "MISSING_FIELD",
         {"field": "idempotency_key"}),
        ("style before disposition", dict(style=bad_style, disposition=9), "INVALID_VALUE", {"field": "style"}),
        ("disposition before lease", dict(disposition=9, lease_ms=0), "INVALID_VALUE", {"field": "disposition"}),
        ("lease before meta", dict(lease_ms=-1, no_meta=True), "INVALID_LEASE", {"lease_ms": -1}),
        ("meta.layout before the key", dict(meta_layout=""), "MISSING_FIELD", {"field": "meta.layout"}),
    ]
    for what, over, reason, meta in rows:
        with ctx.sub(what):
            key = over.pop("idempotency_key", None)
            layout = over.pop("meta_layout", None)
            no_meta = over.pop("no_meta", False)
            lease = over.pop("lease_ms", ABSENT)
            kw = {}
            if layout is not None:
                kw["meta"] = kvconf.default_meta(layout=layout)
            req = c.allocate_req(ctx.key() if key is None else key, lease_ms=lease, no_meta=no_meta, **kw)
            for f, v in over.items():
                setattr(req, f, v)
            refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, reason, meta, what=what)
    with ctx.sub("metadata before the idempotency key"):
        s = c.allocate(ctx.key())
        req = c.allocate_req(s.idempotency_key, meta=kvconf.default_meta(blocks=0))
        refused(ctx, lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "INCOMPATIBLE_METADATA",
                sessions=[s], what="a taken key with a zero KV size")
        c.release(s.session_id)


@case("validate.lease_allocate")
def validate_lease_allocate(ctx):
    c = ctx.client()
    mx = ctx.limits.max_lease_ms
    for lease in (0, -1, -(1 << 63)):
        with ctx.sub(f"lease {lease}"):
            key = ctx.key()
            refused(ctx, lambda: c.allocate(key, lease_ms=lease), SC.INVALID_ARGUMENT, "INVALID_LEASE",
                    {"lease_ms": lease}, what=f"allocate lease_ms={lease}")
    for lease in (mx + 1, (1 << 63) - 1):
        with ctx.sub(f"lease {lease}"):
            refused(ctx, lambda: c.allocate(ctx.key(), lease_ms=lease), SC.INVALID_ARGUMENT,
                    "LEASE_TOO_LONG", {"lease_ms": lease, "max": mx}, what=f"allocate lease_ms={lease}")
    with ctx.sub("lease = max"):
        t0 = kvconf.now_ms()
        s = c.allocate(ctx.key(), lease_ms=mx)
        lease_near(s, mx, t0, kvconf.now_ms(), "lease of max_lease_ms")
    with ctx.sub("lease 1234"):
        t0 = kvconf.now_ms()
        s = c.allocate(ctx.key(), lease_ms=1234)
        lease_near(s, 1234, t0, kvconf.now_ms(), "lease of 1234 ms")
    with ctx.sub("absent lease"):
        t0 = kvconf.now_ms()
        s = c.allocate(ctx.key())
        lease_near(s, ctx.limits.default_lease_ms, t0, kvconf.now_ms(), "absent lease (the default)")
    for sid in list(ctx.created):
        c.release(sid)


@case("validate.lease_renew")
def validate_lease_renew(ctx):
    if not ctx.info.renewable_leases:
        raise Skip("renewable_leases is false (see info.capabilities)")
    c = ctx.client()
    mx = ctx.limits.max_lease_ms
    s = c.allocate(ctx.key(), lease_ms=5000)
    sid = s.session_id
    for lease, reason, meta in ((0, "INVALID_LEASE", {"lease_ms": 0}), (-5, "INVALID_LEASE", {"lease_ms": -5}),
                                (mx + 1, "LEASE_TOO_LONG", {"lease_ms": mx + 1, "max": mx}),
                                ((1 << 63) - 1, "LEASE_TOO_LONG", {"max": mx})):
        with ctx.sub(f"renew {lease}"):
            refused(ctx, lambda: c.renew(sid, lease), SC.INVALID_ARGUMENT, reason, meta, [s],
                    f"renew lease_ms={lease}")
    with ctx.sub("renew absent -> default"):
        t0 = kvconf.now_ms()
        r = c.renew(sid)
        lease_near(r, ctx.limits.default_lease_ms, t0, kvconf.now_ms(), "renew without a lease")
    with ctx.sub("renew shortens"):
        t0 = kvconf.now_ms()
        r = c.renew(sid, 700)
        lease_near(r, 700, t0, kvconf.now_ms(), "renew to 700 ms")
        eq(c.get(sid).lease_expires_at, r.lease_expires_at, "get shows the renewed expiry")
    with ctx.sub("renew max"):
        t0 = kvconf.now_ms()
        r = c.renew(sid, mx)
        lease_near(r, mx, t0, kvconf.now_ms(), "renew to max_lease_ms")
    with ctx.sub("renew in READY and ATTACHED"):
        r, _ = fresh_ready(ctx, c)
        state_is(c.renew(r.session_id, 3000), S["READY"], "renew in READY")
        c.attach(r.session_id)
        state_is(c.renew(r.session_id, 3000), S["ATTACHED"], "renew in ATTACHED")
        c.release(r.session_id)
    c.release(sid)


def session_ops(c, ranges_fn):
    """Every RPC that names a session, as a function of the id."""
    return {
        "GetKvSession": lambda sid: c.get(sid),
        "RenewKvSession": lambda sid: c.renew(sid, 1000),
        "ReleaseKvSession": lambda sid: c.release(sid),
        "AbortKvSession": lambda sid: c.abort(sid),
        "MarkKvSessionReady": lambda sid: c.ready(sid, ranges_fn()),
        "AttachKvSession": lambda sid: c.attach(sid),
        "CompleteKvSession": lambda sid: c.complete(sid),
        "BypassKvSession": lambda sid: c.bypass(sid),
        "RejectKvSession": lambda sid: c.reject(sid, "conformance"),
        "FailKvSession": lambda sid: c.fail(sid, "conformance"),
    }


@case("validate.session_id")
def validate_session_id(ctx):
    c = ctx.client()
    live = c.allocate(ctx.key())
    inc, seq = live.session_id.split("-")
    malformed = ["abc", inc, f"{inc}-", f"-{seq}", f"{inc[:-1]}-{seq}", f"{inc}0-{seq}", f"{inc}-x{seq}",
                 f"{inc}-{seq}-1", f"{inc}--{seq}", f"{inc}-+{seq}", f" {inc}-{seq}", f"{inc}-{seq} ",
                 f"{'g' * 16}-{seq}", f"{inc}_{seq}"]
    if inc != inc.upper():
        malformed.append(f"{inc.upper()}-{seq}")
    other = format(int(inc, 16) ^ 0x1, "016x")
    never = f"{inc}-{int(seq) + 10_000_000}"
    for op, fn in session_ops(c, lambda: ctx.ranges()).items():
        with ctx.sub(f"{op} missing"):
            refused(ctx, lambda: fn(""), SC.INVALID_ARGUMENT, "MISSING_FIELD", {"field": "session_id"},
                    [live], f"{op} without session_id")
        for bad in malformed:
            with ctx.sub(f"{op} {bad!r}"):
                refused(ctx, lambda: fn(bad), SC.INVALID_ARGUMENT, "INVALID_VALUE",
                        {"field": "session_id"}, [live], f"{op} session_id={bad!r}")
        with ctx.sub(f"{op} never allocated"):
            refused(ctx, lambda: fn(never), SC.NOT_FOUND, "SESSION_NOT_FOUND", {"session_id": never},
                    [live], f"{op} {never}")
        with ctx.sub(f"{op} other incarnation"):
            oid = f"{other}-{seq}"
            refused(ctx, lambda: fn(oid), SC.NOT_FOUND, "OTHER_INCARNATION",
                    {"session_id": oid, "incarnation": None}, [live], f"{op} {oid}")
    with ctx.sub("a leading zero does not name the session"):
        r = kvconf.refusal_of(lambda: c.get(f"{inc}-0{seq}"))
        check(r is not None and r.code in (SC.INVALID_ARGUMENT, SC.NOT_FOUND),
              f"get {inc}-0{seq}: {r.describe() if r else 'answered the session'}")
    c.release(live.session_id)


@case("validate.meta_at_ready_and_attach")
def validate_meta_at_ready_and_attach(ctx):
    c = ctx.client()
    s = c.allocate(ctx.key())
    sid = s.session_id
    m = kvconf.default_meta()
    wrong = [("layout", kvconf.default_meta(layout=m.layout + "-other")),
             ("block_bytes", kvconf.default_meta(block_bytes=m.block_bytes * 2, blocks=m.blocks // 2 or 1)),
             ("blocks", kvconf.default_meta(blocks=m.blocks + 1)),
             ("layout case", kvconf.default_meta(layout=m.layout.upper()))]
    for what, meta in wrong:
        with ctx.sub(f"ready with other {what}"):
            refused(ctx, lambda: c.ready(sid, ctx.ranges(), meta), SC.INVALID_ARGUMENT,
                    "INCOMPATIBLE_METADATA", sessions=[s], what=f"mark ready with another {what}")
    with ctx.sub("ready without meta"):
        refused(ctx, lambda: c.ready(sid, ctx.ranges(), None), SC.INVALID_ARGUMENT,
                ("INCOMPATIBLE_METADATA", "MISSING_FIELD"), sessions=[s], what="mark ready without meta")
    r = c.ready(sid, ctx.ranges())
    for what, meta in wrong:
        with ctx.sub(f"attach with other {what}"):
            refused(ctx, lambda: c.attach(sid, meta), SC.INVALID_ARGUMENT, "INCOMPATIBLE_METADATA",
                    sessions=[r], what=f"attach with another {what}")
    with ctx.sub("attach without meta"):
        refused(ctx, lambda: c.attach(sid, None), SC.INVALID_ARGUMENT,
                ("INCOMPATIBLE_METADATA", "MISSING_FIELD"), sessions=[r], what="attach without meta")
    # Metadata is checked before the state: a wrong meta on a context-first
    # session that is not ready is still INCOMPATIBLE_METADATA.
    with ctx.sub("attach with wrong meta before ready"):
        s2 = c.allocate(ctx.key())
        refused(ctx, lambda: c.attach(s2.session_id, wrong[0][1]), SC.INVALID_ARGUMENT,
                "INCOMPATIBLE_METADATA", sessions=[s2], what="attach, wrong meta, not ready")
    state_is(c.attach(sid).session, S["ATTACHED"], "attach with the right meta")
    for x in list(ctx.created):
        c.release(x)


@case("validate.ranges")
def validate_ranges(ctx):
    c = ctx.client()
    s = c.allocate(ctx.key())
    sid = s.session_id
    size = kvconf.kv_size()
    reg = ctx.region()
    R = lambda off, ln: pb.KvRange(registration=reg.registration, offset=reg.offset + off, len=ln)  # noqa: E731
    cases = [("no ranges", []),
             ("one byte short", [R(0, size - 1)]),
             ("one byte more", [R(0, size + 1)] if size + 1 <= reg.len else [R(0, size), R(0, 1)]),
             ("two ranges, short", [R(0, size // 2), R(size // 2, size // 2 - 1)]),
             ("an empty range among exact ones", [R(0, size), R(0, 0)]),
             ("twice the size", [R(0, size), R(0, size)])]
    for what, rg in cases:
        with ctx.sub(what):
            refused(ctx, lambda: c.ready(sid, rg), SC.INVALID_ARGUMENT, "INCOMPATIBLE_METADATA",
                    sessions=[s], what=f"mark ready, {what}")
    mr = ctx.limits.max_ranges
    with ctx.sub("too many ranges"):
        if mr + 1 > reg.len or mr > 100_000:
            raise Skip(f"max_ranges {mr} too large to probe here")
        meta = kvconf.default_meta(block_bytes=1, blocks=mr + 1)
        s2 = c.allocate(ctx.key(), meta=meta)
        many = [R(i, 1) for i in range(mr + 1)]
        refused(ctx, lambda: c.ready(s2.session_id, many, meta), SC.INVALID_ARGUMENT, "TOO_MANY_RANGES",
                {"count": mr + 1, "max": mr}, [s2], f"mark ready with {mr + 1} ranges")
        meta3 = kvconf.default_meta(block_bytes=1, blocks=mr)
        s3 = c.allocate(ctx.key(), meta=meta3)
        before = ctx.stats().pinned_ranges
        r3 = c.ready(s3.session_id, [R(i, 1) for i in range(mr)], meta3)
        state_is(r3, S["READY"], f"mark ready with exactly max_ranges ({mr}) ranges")
        pinned_is(ctx, before + mr, "after max_ranges ranges")
        c.release(s3.session_id)
        pinned_back(ctx, before)
    with ctx.sub("exact in several ranges"):
        r = c.ready(sid, ctx.ranges(3))
        state_is(r, S["READY"], "three ranges summing exactly")
    for x in list(ctx.created):
        c.release(x)


@case("validate.engine_refused")
def validate_engine_refused(ctx):
    c = ctx.client()
    s = c.allocate(ctx.key())
    sid = s.session_id
    size = kvconf.kv_size()
    reg = ctx.region()
    ids = {r.registration for r in ctx.regions}
    unknown = max(ids) + 7919
    cases = [("unknown registration", [pb.KvRange(registration=unknown, offset=0, len=size)]),
             ("registration 0", [pb.KvRange(registration=0, offset=0, len=size)] if 0 not in ids else None),
             ("another generation", [pb.KvRange(registration=reg.registration ^ (1 << 40), offset=0, len=size)]
              if reg.registration ^ (1 << 40) not in ids else None),
             ("range past the end", [pb.KvRange(registration=reg.registration, offset=reg.offset + reg.len,
                                                len=size)]),
             ("range straddling the end", [pb.KvRange(registration=reg.registration,
                                                      offset=reg.offset + reg.len - size // 2, len=size)]),
             ("offset overflow", [pb.KvRange(registration=reg.registration, offset=(1 << 64) - 2, len=size)])]
    for what, rg in cases:
        if rg is None:
            continue
        with ctx.sub(what):
            refused(ctx, lambda: c.ready(sid, rg), SC.FAILED_PRECONDITION, "ENGINE_REFUSED",
                    sessions=[s], what=f"mark ready, {what}")
    with ctx.sub("the session is still usable"):
        state_is(c.ready(sid, ctx.ranges()), S["READY"], "mark ready after refusals")
    c.release(sid)


@case("validate.reason_too_long")
def validate_reason_too_long(ctx):
    c = ctx.client()
    mx = ctx.limits.max_field_bytes
    s = c.allocate(ctx.key())
    sid = s.session_id
    for op in ("reject", "fail"):
        with ctx.sub(op):
            fn = getattr(c, op)
            refused(ctx, lambda: fn(sid, "r" * (mx + 1)), SC.INVALID_ARGUMENT, "FIELD_TOO_LONG",
                    {"field": "reason", "len": mx + 1, "max": mx}, [s], f"{op} with a reason of {mx + 1} bytes")
    f = c.fail(sid, "f" * mx)
    state_is(f, S["FAILED"], "fail with a reason of exactly max_field_bytes")
    eq(f.reason, "f" * mx, "reason")


# ---------------------------------------------------------------- states

@case("state.wrong_state")
def state_wrong_state(ctx):
    c = ctx.client()
    with ctx.sub("ALLOCATED"):
        s = c.allocate(ctx.key(), style=CF)
        refused(ctx, lambda: c.complete(s.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": s.session_id, "state": lambda v: kvconf.norm_state(v) == "allocated", "op": None},
                [s], "complete in ALLOCATED")
        refused(ctx, lambda: c.bypass(s.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": s.session_id}, [s], "bypass of a REQUIRED session in ALLOCATED")
    with ctx.sub("READY"):
        r, rg = fresh_ready(ctx, c)
        refused(ctx, lambda: c.ready(r.session_id, rg), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": r.session_id, "state": lambda v: kvconf.norm_state(v) == "ready"}, [r],
                "mark ready in READY")
        refused(ctx, lambda: c.complete(r.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": r.session_id}, [r], "complete in READY")
    with ctx.sub("ATTACHED"):
        r, rg = fresh_ready(ctx, c)
        a = c.attach(r.session_id).session
        refused(ctx, lambda: c.ready(r.session_id, rg), SC.FAILED_PRECONDITION, "WRONG_STATE",
                {"session_id": r.session_id, "state": lambda v: kvconf.norm_state(v) == "attached"}, [a],
                "mark ready in ATTACHED")
    for gstyle in (GF, CONC):
        if not supported(ctx, gstyle):
            continue
        with ctx.sub(f"queued {pb.KvScheduleStyle.Name(gstyle)}"):
            s = c.allocate(ctx.key(), style=gstyle)
            q = c.attach(s.session_id).session
            refused(ctx, lambda: c.complete(s.session_id), SC.FAILED_PRECONDITION, "WRONG_STATE",
                    {"session_id": s.session_id}, [q], "complete while queued")
            eq(c.attach(s.session_id).queued, True, "attach again while queued")
    for x in list(ctx.created):
        c.release(x)


def make_terminal(ctx, c, state):
    if state == "COMPLETE":
        r, _ = fresh_ready(ctx, c)
        c.attach(r.session_id)
        return c.complete(r.session_id)
    if state == "BYPASSED":
        s = c.allocate(ctx.key(), disposition=BYPASS)
        return c.bypass(s.session_id)
    if state == "REJECTED":
        r, _ = fresh_ready(ctx, c)
        return c.reject(r.session_id, "no")
    if state == "CANCELLED":
        r, _ = fresh_ready(ctx, c)
        return c.abort(r.session_id)
    if state == "FAILED":
        r, _ = fresh_ready(ctx, c)
        c.attach(r.session_id)
        return c.fail(r.session_id, "broken")
    if state == "RELEASED":
        r, _ = fresh_ready(ctx, c)
        c.release(r.session_id)
        return c.get(r.session_id)
    if state == "EXPIRED":
        r, _ = fresh_ready(ctx, c, lease_ms=150)
        return wait_state(c, r.session_id, S["EXPIRED"])
    raise AssertionError(state)


@case("state.terminal_never_changes")
def state_terminal_never_changes(ctx):
    c = ctx.client()
    states = ["COMPLETE", "REJECTED", "CANCELLED", "FAILED", "RELEASED", "EXPIRED"]
    if ctx.info.conditional_bypass:
        states.insert(1, "BYPASSED")
    for name in states:
        with ctx.sub(name):
            t = make_terminal(ctx, c, name)
            sid = t.session_id
            state_is(t, S[name], f"made {name}")
            pinned_back(ctx)
            t = c.get(sid)
            ops = session_ops(c, lambda: ctx.ranges())
            for op in ("MarkKvSessionReady", "AttachKvSession", "CompleteKvSession", "BypassKvSession",
                       "RejectKvSession", "FailKvSession", "RenewKvSession"):
                with ctx.sub(f"{name} {op}"):
                    refused(ctx, lambda: ops[op](sid), SC.FAILED_PRECONDITION, "SESSION_ENDED",
                            ended_meta(sid, S[name]), [t], f"{op} on {name}")
            with ctx.sub(f"{name} abort"):
                eq(c.abort(sid), t, f"abort of {name} returns it unchanged")
            with ctx.sub(f"{name} release"):
                rel = c.release(sid)
                eq((rel.session_id, rel.state, rel.released_now), (sid, S[name], False),
                   f"release of {name}")
                eq(rel.HasField("reason"), t.HasField("reason"), "release reports the reason")
                eq(rel.reason, t.reason, "release reason")
            eq(c.get(sid), t, f"{name} after every call")
            if name == "EXPIRED":
                eq(t.reason, "lease expired", "reason of EXPIRED")


@case("state.racing_endings")
def state_racing_endings(ctx):
    """Complete, reject, fail and abort race on one attached session: one
    wins, the others see it ended (or, for abort, get it unchanged)."""
    for rnd in range(5):
        c = ctx.client()
        r, _ = fresh_ready(ctx, c)
        sid = r.session_id
        c.attach(sid)
        results = {}
        barrier = threading.Barrier(4)

        def run(name, fn):
            cl = kvconf.Client(ctx.addr)
            try:
                barrier.wait()
                results[name] = ("ok", fn(cl))
            except grpc.RpcError as e:
                results[name] = ("err", kvconf.Refusal(e))
            finally:
                cl.close()
        ths = [threading.Thread(target=run, args=a) for a in (
            ("complete", lambda cl: cl.complete(sid)), ("reject", lambda cl: cl.reject(sid, "race")),
            ("fail", lambda cl: cl.fail(sid, "race")), ("abort", lambda cl: cl.abort(sid)))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(15)
        final = c.get(sid)
        winners = [n for n, (k, v) in results.items() if k == "ok" and n != "abort"]
        check(len(winners) <= 1, f"round {rnd}: more than one ending succeeded: {winners}")
        for n, (k, v) in results.items():
            if k == "err":
                check(v.reason == "SESSION_ENDED", f"round {rnd}: {n} lost with {v.describe()}")
            elif n != "abort":
                eq(v.state, final.state, f"round {rnd}: the winner's state vs the final one")
        if results.get("abort", ("", None))[0] == "ok":
            ab = results["abort"][1]
            check(ab.state == final.state, f"round {rnd}: abort answered {kvconf.state_name(ab.state)}, "
                                           f"final {kvconf.state_name(final.state)}")
        check(final.state in (S["COMPLETE"], S["REJECTED"], S["FAILED"], S["CANCELLED"]),
              f"round {rnd}: final {kvconf.state_name(final.state)}")
        pinned_back(ctx)


# ---------------------------------------------------------------- idempotency

@case("idempotency.retry")
def idempotency_retry(ctx):
    c, c2 = ctx.client(), ctx.client()
    key = ctx.key()
    req = c.allocate_req(key, lease_ms=5000, style=ctx.info.supported_styles[0])
    s = c.allocate(req=req)
    before = ctx.stats()
    again = c2.allocate(req=req)
    eq(again.session_id, s.session_id, "identical retry: session id")
    eq(ctx.stats().live_sessions, before.live_sessions, "live_sessions after an identical retry")
    eq((again.request_id, again.model, again.idempotency_key, again.meta),
       (s.request_id, s.model, s.idempotency_key, s.meta), "identical retry: fields")
    rg = ctx.ranges()
    c.ready(s.session_id, rg)
    ra = c2.allocate(req=req)
    state_is(ra, S["READY"], "identical retry returns the session as it is now")
    eq(list(ra.rendezvous.ranges), rg, "retry's ranges")
    eq(ctx.stats().pinned_ranges, before.pinned_ranges + 1, "pinned after retry of a ready session")
    c.attach(s.session_id)
    c.complete(s.session_id)
    pinned_back(ctx, before.pinned_ranges)
    done = c2.allocate(req=req)
    eq(done.session_id, s.session_id, "identical retry after it ended: id")
    state_is(done, S["COMPLETE"], "identical retry after it ended")
    eq(ctx.stats().live_sessions, before.live_sessions - 1, "live after the retry of an ended session")
    with ctx.sub("retry with absent lease"):
        r2 = c.allocate_req(ctx.key())
        a = c.allocate(req=r2)
        b = c.allocate(req=r2)
        eq(a.session_id, b.session_id, "identical retry without lease")
        c.release(a.session_id)


@case("idempotency.conflict")
def idempotency_conflict(ctx):
    c = ctx.client()
    key = ctx.key()
    base = c.allocate_req(key, lease_ms=5000, style=CF, disposition=REQUIRED)
    s = c.allocate(req=base)
    sid = s.session_id
    other_style = next((x for x in (GF, CONC) if supported(ctx, x)), UNSPEC)
    variants = [("request_id", dict(request_id="other-request")),
                ("model", dict(model="other-model")),
                ("style", dict(style=other_style)),
                ("lease_ms", dict(lease_ms=5001)),
                ("meta.layout", dict(meta=kvconf.default_meta(layout="other-layout"))),
                ("meta.blocks", dict(meta=kvconf.default_meta(blocks=kvconf.default_meta().blocks + 1))),
                ("meta.block_bytes", dict(meta=kvconf.default_meta(block_bytes=kvconf.default_meta().block_bytes + 1)))]
    if ctx.info.conditional_bypass:
        variants.append(("disposition", dict(disposition=BYPASS)))
    for what, over in variants:
        with ctx.sub(what):
            kw = dict(lease_ms=5000, style=CF, disposition=REQUIRED)
            kw.update(over)
            req = c.allocate_req(key, **kw)
            if what == "request_id":
                req.request_id = "other-request"
            refused(ctx, lambda: c.allocate(req=req), SC.ALREADY_EXISTS, "IDEMPOTENCY_CONFLICT",
                    {"idempotency_key": key, "session_id": sid}, [s], f"same key, other {what}")
    c.release(sid)
    with ctx.sub("conflict with a tombstone"):
        req = c.allocate_req(key, lease_ms=5000, style=CF, model="other-model")
        refused(ctx, lambda: c.allocate(req=req), SC.ALREADY_EXISTS, "IDEMPOTENCY_CONFLICT",
                {"idempotency_key": key, "session_id": sid}, what="same key as an ended session")
        eq(c.allocate(req=base).session_id, sid, "the original request still answers its session")


@case("idempotency.concurrent_retries")
def idempotency_concurrent_retries(ctx):
    key = ctx.key()
    n = 24
    ids, errs = [], []
    barrier = threading.Barrier(n)
    proto = kvconf.Client(ctx.addr).allocate_req(key, lease_ms=5000)

    def run():
        cl = kvconf.Client(ctx.addr)
        try:
            barrier.wait()
            ids.append(cl.allocate(req=proto).session_id)
        except Exception as e:
            errs.append(e)
        finally:
            cl.close()
    before = ctx.stats().live_sessions
    ths = [threading.Thread(target=run) for _ in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(20)
    for i in set(ids):
        ctx.created.add(i)
    check(not errs, f"{len(errs)} of {n} identical concurrent allocations failed: {errs[:2]}")
    check(len(set(ids)) == 1, f"{n} identical concurrent allocations made {len(set(ids))} sessions")
    eq(ctx.stats().live_sessions, before + 1, "live_sessions after concurrent identical allocations")
    ctx.admin.release(ids[0])


# ---------------------------------------------------------------- tombstones

@case("tombstone.queryable")
def tombstone_queryable(ctx):
    c = ctx.client()
    r, _ = fresh_ready(ctx, c)
    sid = r.session_id
    c.attach(sid)
    done = c.complete(sid)
    st = ctx.stats()
    check(st.tombstones >= 1, f"tombstones {st.tombstones} with a just-ended session")
    g = c.get(sid)
    eq(g, done, "the tombstone as get returns it")
    for _ in range(2):
        rel = c.release(sid)
        eq((rel.released_now, rel.state), (False, S["COMPLETE"]), "release of a tombstone")
        eq(c.abort(sid), done, "abort of a tombstone")
    eq(c.get(sid), done, "the tombstone after release and abort")


@case("tombstone.retention")
def tombstone_retention(ctx):
    ret = ctx.limits.tombstone_retention_ms
    if ret > 5000:
        raise Skip(f"tombstone_retention_ms is {ret} ms (> 5 s); "
                   f"start the server with a short retention to test it")
    c = ctx.client()
    req = c.allocate_req(ctx.key(), lease_ms=5000)
    s = c.allocate(req=req)
    sid = s.session_id
    t_end = time.monotonic()
    c.release(sid)
    check(ctx.stats().tombstones >= 1 or ret < 100, "the release left no tombstone")
    # Still queryable well within the retention.
    if ret >= 400:
        state_is(c.get(sid), S["RELEASED"], "get within the retention")
    got = poll_until(lambda: kvconf.refusal_of(lambda: c.get(sid)), ret / 1000 + 2.0, 0.05)
    dt = time.monotonic() - t_end
    check(got is not None, f"{sid} still answers {ret + 2000} ms after it ended")
    check(dt * 1000 >= ret - 50, f"the tombstone went after {dt * 1000:.0f} ms, before its {ret} ms retention")
    check(got.reason == "SESSION_NOT_FOUND", f"get past retention: {got.describe()}")
    expect_err(lambda: c.release(sid), SC.NOT_FOUND, "SESSION_NOT_FOUND", {"session_id": sid},
               "release past retention")
    expect_err(lambda: c.abort(sid), SC.NOT_FOUND, "SESSION_NOT_FOUND", {"session_id": sid},
               "abort past retention")
    n = c.allocate(req=req)
    check(n.session_id != sid, f"the same request past retention answered the old id {sid}")
    state_is(n, S["ALLOCATED"], "the key is free again")
    c.release(n.session_id)


@case("tombstone.stats")
def tombstone_stats(ctx):
    c = ctx.client()
    before = ctx.stats()
    r, _ = fresh_ready(ctx, c)
    st = ctx.stats()
    eq(st.live_sessions, before.live_sessions + 1, "live_sessions with one ready session")
    eq(st.pinned_ranges, before.pinned_ranges + 1, "pinned_ranges with one ready session")
    c.release(r.session_id)
    st = poll_until(lambda: (lambda x: x if x.awaiting_cleanup == 0 and x.pinned_ranges == 0 else None)(
        ctx.stats()), 2.0)
    check(st, f"awaiting_cleanup/pinned do not return to 0: {short(ctx.stats())}")
    eq(st.live_sessions, before.live_sessions, "live_sessions after release")


# ---------------------------------------------------------------- leases

@case("lease.renew_while_queued")
def lease_renew_while_queued(ctx):
    if not ctx.info.renewable_leases:
        raise Skip("renewable_leases is false")
    style = GF if supported(ctx, GF) else CONC if supported(ctx, CONC) else None
    if style is None:
        raise Skip("no style that queues (GenerationFirst, Concurrent) is supported")
    c = ctx.client()
    lease = 400
    s = c.allocate(ctx.key(), style=style, lease_ms=lease)
    sid = s.session_id
    check(c.attach(sid).queued, "attach before ready is queued")
    # A session that is not renewed expires meanwhile: the control.
    ctl = c.allocate(ctx.key(), style=style, lease_ms=lease)
    c.attach(ctl.session_id)
    t_end = time.monotonic() + 3 * lease / 1000
    while time.monotonic() < t_end:
        r = c.renew(sid, lease)
        state_is(r, S["ALLOCATED"], "renewed while queued")
        time.sleep(lease / 3000)
    state_is(c.get(sid), S["ALLOCATED"], f"alive {3 * lease} ms after a {lease} ms lease")
    eq(c.get(sid).consumer_queued, True, "still queued")
    e = wait_state(c, ctl.session_id, S["EXPIRED"], 2.0)
    eq(e.consumer_queued, False, "an expired queued session: consumer_queued cleared")
    c.ready(sid, ctx.ranges())
    state_is(c.attach(sid).session, S["ATTACHED"], "attach after the long wait")
    state_is(c.complete(sid), S["COMPLETE"], "complete")


@case("lease.expiry_by_reaper")
def lease_expiry_by_reaper(ctx):
    c = ctx.client()
    st0 = ctx.stats()
    lease = 300
    t0 = time.monotonic()
    r, rg = fresh_ready(ctx, c, lease_ms=lease)
    sid = r.session_id
    pinned_is(ctx, st0.pinned_ranges + 1, "after ready")
    # No client call on the session: only the reaper can end it.
    st = poll_until(lambda: (lambda x: x if x.sessions_expired > st0.sessions_expired
                             and x.pinned_ranges == st0.pinned_ranges else None)(ctx.stats()), 3.0)
    dt = time.monotonic() - t0
    check(st, f"no expiry seen through stats within 3 s: {short(ctx.stats())}")
    check(dt * 1000 >= lease - 50, f"expired after {dt * 1000:.0f} ms, before its {lease} ms lease")
    check(st.reaper_ticks > st0.reaper_ticks, "reaper_ticks did not grow")
    eq(st.live_sessions, st0.live_sessions, "live_sessions after expiry")
    g = c.get(sid)
    state_is(g, S["EXPIRED"], "get after expiry")
    eq(g.reason, "lease expired", "reason")
    for op, fn in (("attach", lambda: c.attach(sid)), ("renew", lambda: c.renew(sid, 1000)),
                   ("mark ready", lambda: c.ready(sid, rg)), ("complete", lambda: c.complete(sid))):
        with ctx.sub(f"late {op}"):
            refused(ctx, fn, SC.FAILED_PRECONDITION, "SESSION_ENDED", ended_meta(sid, S["EXPIRED"]), [g],
                    f"late {op}")
    rel = c.release(sid)
    eq((rel.released_now, rel.state), (False, S["EXPIRED"]), "release after expiry")


@case("lease.reaper_order")
def lease_reaper_order(ctx):
    """A renewal to a long lease must not hide shorter leases behind it."""
    c = ctx.client()
    st0 = ctx.stats()
    long_ = c.allocate(ctx.key(), lease_ms=200)
    shorts = [c.allocate(ctx.key(), lease_ms=250 + 10 * i) for i in range(5)]
    if ctx.info.renewable_leases:
        c.renew(long_.session_id, 10_000)
    for s in shorts:
        wait_state(c, s.session_id, S["EXPIRED"], 2.5)
    st = ctx.stats()
    check(st.sessions_expired >= st0.sessions_expired + 5, "sessions_expired did not count 5")
    if ctx.info.renewable_leases:
        state_is(c.get(long_.session_id), S["ALLOCATED"], "the renewed session")
    c.release(long_.session_id)


# ---------------------------------------------------------------- sessionless

@case("sessionless.check")
def sessionless_check(ctx):
    c = ctx.client()
    i = ctx.info
    for disp in (UNSPEC, REQUIRED, BYPASS):
        name = pb.KvTransferDisposition.Name(disp)
        ok = i.local_prefill or (disp == BYPASS and i.conditional_bypass)
        with ctx.sub(name):
            if ok:
                c.sessionless(disp)
            else:
                refused(ctx, lambda: c.sessionless(disp), SC.FAILED_PRECONDITION, "SESSION_REQUIRED",
                        what=f"CheckSessionlessDecode({name})")


# ---------------------------------------------------------------- processes

@case("participant.killed")
def participant_killed(ctx):
    reg = ctx.region()
    rg = ctx.ranges()[0]
    key = ctx.key()
    st0 = ctx.stats()
    lease = 500
    cmd = [sys.executable, os.path.join(HERE, "participant.py"), ctx.addr, ctx.stub_dir, key, str(lease),
           str(reg.registration), str(rg.offset), str(kvconf.default_meta().block_bytes),
           str(kvconf.default_meta().blocks)]
    p = kvconf.spawn(cmd)
    out = kvconf.OutputReader(p)
    line = out.wait_for(lambda l: l.startswith("session "), 15)
    if line is None:
        p.kill()
        raise Failure(f"the participant printed no session: {out.text()[-600:]!r}")
    sid, state = line.split()[1:3]
    ctx.created.add(sid)
    eq(state, "KV_SESSION_STATE_READY", "the participant's session")
    pinned_is(ctx, st0.pinned_ranges + 1, "while the participant holds it")
    t_kill = time.monotonic()
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    kvconf.forget(p)
    c = ctx.client()
    g = wait_state(c, sid, S["EXPIRED"], 3.0)
    eq(g.reason, "lease expired", "reason")
    pinned_back(ctx, st0.pinned_ranges)
    check(time.monotonic() - t_kill < 3.0, "reclaimed too late")
    st = ctx.stats()
    check(st.sessions_expired > st0.sessions_expired, "sessions_expired did not grow")


@case("concurrency.hundred_clients")
def concurrency_hundred_clients(ctx):
    n = 100
    errs, done = [], []
    barrier = threading.Barrier(n)
    keys = [ctx.key(f"c{i}") for i in range(n)]
    rgs = [ctx.ranges(1, slot=i) for i in range(n)]
    lock = threading.Lock()

    def run(i):
        cl = kvconf.Client(ctx.addr)
        try:
            cl.channel_ready = grpc.channel_ready_future(cl.channel).result(timeout=10)
            barrier.wait(30)
            s = cl.allocate(keys[i], lease_ms=20_000)
            with lock:
                ctx.created.add(s.session_id)
            r = cl.ready(s.session_id, rgs[i])
            assert r.state == S["READY"], f"ready {kvconf.state_name(r.state)}"
            a = cl.attach(s.session_id)
            assert a.session.state == S["ATTACHED"], f"attach {kvconf.state_name(a.session.state)}"
            assert list(a.session.rendezvous.ranges) == rgs[i], "ranges differ"
            d = cl.complete(s.session_id)
            assert d.state == S["COMPLETE"], f"complete {kvconf.state_name(d.state)}"
            rel = cl.release(s.session_id)
            assert rel.state == S["COMPLETE"] and not rel.released_now, "release after complete"
            with lock:
                done.append(s.session_id)
        except grpc.RpcError as e:
            with lock:
                errs.append(f"client {i}: {kvconf.Refusal(e).describe()}")
        except Exception as e:
            with lock:
                errs.append(f"client {i}: {type(e).__name__} {e}")
        finally:
            cl.close()
    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    check(not errs, f"{len(errs)} of {n} clients failed: {errs[:3]}")
    eq(len(set(done)), n, "distinct completed sessions")
    pinned_back(ctx)
    ctx.note(f"{n} concurrent flows in {time.monotonic() - t0:.2f}s")


# ---------------------------------------------------------------- wire

@case("wire.malformed_messages")
def wire_malformed_messages(ctx):
    c = ctx.client()
    bad = [("GetKvSession", b"\xff", "a truncated tag"),
           ("GetKvSession", b"\x0a\x05ab", "a string longer than the message"),
           ("GetKvSession", b"\x0a" + b"\xff" * 11, "a length varint of 11 bytes"),
           ("GetKvSession", b"\x00\x01", "field number 0"),
           ("AllocateKvSession", b"\x3a\x02\x10", "meta with a truncated varint"),
           ("MarkKvSessionReady", b"\x12\x03\x08\xff", "a range with a truncated varint"),
           ("GetKvSessionStats", b"\x0f", "wire type 7"),
           ("DrainKvSessions", b"\x08", "timeout_ms without its value")]
    before = ctx.stats()
    for method, payload, what in bad:
        with ctx.sub(f"{method} {what}"):
            expect_err(lambda: c.raw(method, payload), SC.INVALID_ARGUMENT, "MALFORMED_MESSAGE",
                       what=f"{method} with {what}")
    with ctx.sub("invalid UTF-8 in a string"):
        expect_err(lambda: c.raw("GetKvSession", b"\x0a\x02\xc3\x28"), SC.INVALID_ARGUMENT, None,
                   what="session_id of invalid UTF-8")
        expect_err(lambda: c.raw("AllocateKvSession", b"\x0a\x02\xc3\x28"), SC.INVALID_ARGUMENT, None,
                   what="request_id of invalid UTF-8")
    st = ctx.stats()
    eq(st.draining, False, "malformed DrainKvSessions started a drain")
    assert_unchanged(ctx, before, what="after malformed messages")
    c.info()
    c.echo(b"still serving")


@case("wire.unknown_fields_ignored")
def wire_unknown_fields_ignored(ctx):
    c = ctx.client()
    unk = b"\xf8\x06\x01" + b"\x82\x07\x03abc"  # field 111 varint, field 112 bytes
    got = c.raw("GetKvSessionStats", unk)
    st = pb.KvSessionStats.FromString(got)
    eq(st.incarnation, ctx.inc, "stats with unknown fields")
    s = c.allocate(ctx.key())
    g = pb.KvSession.FromString(c.raw("GetKvSession", pb.GetKvSessionRequest(session_id=s.session_id)
                                      .SerializeToString() + unk))
    eq(g.session_id, s.session_id, "get with unknown fields")
    c.release(s.session_id)


@case("wire.oversized_message")
def wire_oversized_message(ctx):
    c = ctx.client()
    mx = ctx.limits.max_message_bytes
    if mx > 64 << 20:
        raise Skip(f"max_message_bytes {mx} is too large to send here")
    codes = (SC.RESOURCE_EXHAUSTED, SC.OUT_OF_RANGE)
    before = ctx.stats()
    with ctx.sub("Echo"):
        expect_err(lambda: c.echo(b"\x00" * (mx + 64)), codes, None, what=f"Echo of {mx + 64} bytes")
    with ctx.sub("Allocate"):
        key = ctx.key()
        req = c.allocate_req(key, request_id="r" * (mx + 64))
        expect_err(lambda: c.allocate(req=req), codes, None, what=f"Allocate of {mx + 64} bytes")
    assert_unchanged(ctx, before, what="after oversized messages")
    with ctx.sub("the limit itself"):
        n = mx - 8
        while pb.EchoRequest(payload=b"\x00" * n).ByteSize() < mx:
            n += 1
        check(pb.EchoRequest(payload=b"\x00" * n).ByteSize() == mx, "cannot size an Echo to the limit")
        eq(len(c.echo(b"\x00" * n).payload), n, f"Echo request of exactly max_message_bytes ({mx})")
        expect_err(lambda: c.echo(b"\x00" * (n + 1)), codes, None, what=f"Echo request of {mx + 1} bytes")
    with ctx.sub("still serving"):
        eq(c.echo(b"ping").payload, b"ping", "echo after oversized")
        if mx > 4096:
            p = os.urandom(min(mx - 1024, 1 << 20))
            eq(c.echo(p).payload, p, f"echo of {len(p)} bytes (under the limit)")


@case("wire.echo")
def wire_echo(ctx):
    c = ctx.client()
    for p in (b"", b"x", os.urandom(1000), bytes(range(256))):
        eq(c.echo(p).payload, p, f"echo of {len(p)} bytes")


# ---------------------------------------------------------------- limits

@case("limits.too_many_sessions")
def limits_too_many_sessions(ctx):
    lim = ctx.limits.max_live_sessions
    live = ctx.stats().live_sessions
    if lim - live > 2048:
        raise Skip(f"max_live_sessions {lim} is too large to fill (start the server with <= 2048)")
    c = ctx.client()
    reqs = []
    for i in range(lim - live):
        r = c.allocate_req(ctx.key(f"l{i}"), lease_ms=20_000)
        c.allocate(req=r)
        reqs.append(r)
    eq(ctx.stats().live_sessions, lim, "live_sessions at the limit")
    refused(ctx, lambda: c.allocate(ctx.key()), SC.RESOURCE_EXHAUSTED, "TOO_MANY_SESSIONS", {"limit": lim},
            what="one session over max_live_sessions")
    with ctx.sub("identical retry at the limit"):
        again = c.allocate(req=reqs[0])
        state_is(again, S["ALLOCATED"], "identical retry at the limit")
    with ctx.sub("validation before the limit"):
        refused(ctx, lambda: c.allocate(ctx.key(), lease_ms=0), SC.INVALID_ARGUMENT, "INVALID_LEASE",
                what="a bad lease at the limit")
    first = c.allocate(req=reqs[0]).session_id
    c.release(first)
    with ctx.sub("a slot frees after release"):
        s = c.allocate(ctx.key())
        c.release(s.session_id)
    for sid in list(ctx.created):
        c.release(sid)


@case("limits.concurrent_at_limit")
def limits_concurrent_at_limit(ctx):
    """Allocations racing at max_live_sessions: exactly the free slots are
    granted, the rest fail TOO_MANY_SESSIONS."""
    lim = ctx.limits.max_live_sessions
    live = ctx.stats().live_sessions
    free = lim - live
    if free > 1024:
        raise Skip(f"max_live_sessions {lim} is too large to fill (start the server with <= 1024 free)")
    extra, nthreads = 40, 16
    keys = [ctx.key(f"r{i}") for i in range(free + extra)]
    got, refusals, errs = [], [], []
    lock = threading.Lock()
    barrier = threading.Barrier(nthreads)

    def run(part):
        cl = kvconf.Client(ctx.addr)
        try:
            barrier.wait(20)
            for k in part:
                try:
                    s = cl.allocate(k, lease_ms=20_000)
                    with lock:
                        got.append(s.session_id)
                        ctx.created.add(s.session_id)
                except grpc.RpcError as e:
                    r = kvconf.Refusal(e)
                    with lock:
                        (refusals if r.reason == "TOO_MANY_SESSIONS" else errs).append(r.describe())
        finally:
            cl.close()
    ths = [threading.Thread(target=run, args=(keys[i::nthreads],)) for i in range(nthreads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    st = ctx.stats()
    check(not errs, f"other refusals: {errs[:3]}")
    eq(len(got), free, f"sessions granted to {free + extra} racing allocations with {free} free slots")
    eq(len(refusals), extra, "TOO_MANY_SESSIONS refusals")
    eq(st.live_sessions, lim, "live_sessions")
    for sid in got:
        ctx.admin.release(sid)


@case("perf.no_transport_stalls")
def perf_no_transport_stalls(ctx):
    """Loopback unary calls take about a millisecond; a call that takes
    ~40 ms is a Nagle/delayed-ACK stall (TCP_NODELAY not set on accepted
    connections)."""
    c = ctx.client()
    s = c.allocate(ctx.key())
    rows = []
    for name, fn in (("Echo of 2000 bytes", lambda: c.echo(b"x" * 2000)),
                     ("Echo of 16 bytes", lambda: c.echo(b"x" * 16)),
                     ("GetKvSessionStats then GetKvSession", lambda: (c.stats(), c.get(s.session_id)))):
        ds = []
        for _ in range(15):
            t0 = time.monotonic()
            fn()
            ds.append((time.monotonic() - t0) * 1000)
        ds.sort()
        rows.append((name, ds[len(ds) // 2], ds[-1], sum(d > 30 for d in ds)))
    c.release(s.session_id)
    ctx.note("; ".join(f"{n}: median {m:.1f} ms, max {x:.1f} ms, {k} over 30 ms" for n, m, x, k in rows))
    bad = [f"{n}: median {m:.1f} ms ({k} of 15 calls over 30 ms)" for n, m, x, k in rows if m > 20 or k > 3]
    check(not bad, "; ".join(bad))


@case("drain.invalid_timeout")
def drain_invalid_timeout(ctx):
    c = ctx.client()
    for t in (-1, -(1 << 63)):
        with ctx.sub(f"timeout {t}"):
            refused(ctx, lambda: c.drain(t, True), SC.INVALID_ARGUMENT, "INVALID_VALUE",
                    {"field": "timeout_ms"}, what=f"DrainKvSessions(timeout_ms={t})")
    eq(ctx.stats().draining, False, "a refused drain must not start draining")
    s = c.allocate(ctx.key())
    c.release(s.session_id)


# ---------------------------------------------------------------- own servers

def own_server(ctx, **kw):
    if not ctx.orbite:
        raise Skip("needs --orbite BIN to start its own servers")
    return kvconf.Server(ctx.orbite, **kw)


def server_regions(cl):
    rs = list(cl.stats().kv_regions)
    check(rs, "the server lists no kv_regions")
    return rs


@case("server.restricted_config", orbite=True)
def server_restricted_config(ctx):
    cfg = {"sessions": {"supported_styles": ["GenerationFirst"], "default_style": "GenerationFirst",
                        "conditional_bypass": False, "local_prefill": True, "renewable_leases": False,
                        "max_live_sessions": 3, "max_field_bytes": 32, "max_ranges": 2,
                        "default_lease_ms": 1500, "max_lease_ms": 5000, "tombstone_retention_ms": 300,
                        "max_tombstones": 4},
           "max_message_bytes": 65536, "reaper_period_ms": 5}
    srv = own_server(ctx, config=cfg)
    try:
        c = kvconf.Client(srv.addr)
        c.style = UNSPEC
        i = c.info()
        L = i.limits
        with ctx.sub("advertised"):
            eq(list(i.supported_styles), [GF], "supported_styles")
            eq(i.default_style, GF, "default_style")
            eq((i.conditional_bypass, i.local_prefill, i.renewable_leases), (False, True, False),
               "conditional_bypass, local_prefill, renewable_leases")
            eq((L.max_live_sessions, L.max_field_bytes, L.max_ranges, L.default_lease_ms, L.max_lease_ms,
                L.tombstone_retention_ms, L.max_tombstones, L.max_message_bytes),
               (3, 32, 2, 1500, 5000, 300, 4, 65536), "limits")
        reg = server_regions(c)[0]
        rng = lambda n=1: [pb.KvRange(registration=reg.registration, offset=reg.offset + k * (kvconf.kv_size() // n),  # noqa
                                      len=kvconf.kv_size() // n) for k in range(n)]
        k = [0]

        def key():
            k[0] += 1
            return f"rc{k[0]}"
        sessions = []
        with ctx.sub("styles"):
            for st in (CF, CONC):
                expect_err(lambda: c.allocate(key(), style=st), SC.FAILED_PRECONDITION, "UNSUPPORTED_STYLE",
                           {"style": None}, f"allocate {pb.KvScheduleStyle.Name(st)}")
            t0 = kvconf.now_ms()
            s = c.allocate(key(), style=UNSPEC)
            sessions.append(s)
            eq((s.style, s.effective_style), (UNSPEC, GF), "style, effective_style of UNSPECIFIED")
            lease_near(s, 1500, t0, kvconf.now_ms(), "the configured default lease")
            eq(c.attach(s.session_id).queued, True, "the default GenerationFirst queues")
        with ctx.sub("bypass"):
            expect_err(lambda: c.allocate(key(), disposition=BYPASS), SC.FAILED_PRECONDITION,
                       "BYPASS_NOT_SUPPORTED", None, "allocate BYPASS")
        with ctx.sub("order: presence, style, disposition, lease"):
            req = c.allocate_req(key(), style=CF)
            req.idempotency_key = ""
            expect_err(lambda: c.allocate(req=req), SC.INVALID_ARGUMENT, "MISSING_FIELD",
                       {"field": "idempotency_key"}, "no key and an unsupported style")
            expect_err(lambda: c.allocate(key(), style=CF, disposition=BYPASS), SC.FAILED_PRECONDITION,
                       "UNSUPPORTED_STYLE", None, "an unsupported style and an unsupported bypass")
            expect_err(lambda: c.allocate(key(), disposition=BYPASS, lease_ms=0), SC.FAILED_PRECONDITION,
                       "BYPASS_NOT_SUPPORTED", None, "an unsupported bypass and a zero lease")
        with ctx.sub("renew"):
            s = c.allocate(key(), style=UNSPEC)
            sessions.append(s)
            g = c.get(s.session_id)
            expect_err(lambda: c.renew(s.session_id, 1000), SC.FAILED_PRECONDITION, "WRONG_STATE",
                       {"session_id": s.session_id}, "renew, leases not renewable")
            eq(c.get(s.session_id), g, "unchanged by the refused renew")
            c.release(s.session_id)
        with ctx.sub("sessionless with local_prefill"):
            c.sessionless(REQUIRED)
            c.sessionless(BYPASS)
        with ctx.sub("field limit"):
            expect_err(lambda: c.allocate("k" * 33, request_id="r1"), SC.INVALID_ARGUMENT, "FIELD_TOO_LONG",
                       {"field": "idempotency_key", "len": 33, "max": 32}, "key of 33 bytes")
            s = c.allocate("k" * 32, request_id="r" * 32)
            sessions.append(s)
        with ctx.sub("lease limit"):
            expect_err(lambda: c.allocate(key(), lease_ms=5001), SC.INVALID_ARGUMENT, "LEASE_TOO_LONG",
                       {"max": 5000}, "lease 5001")
        with ctx.sub("ranges limit"):
            s = c.allocate(key(), style=GF)
            sessions.append(s)
            expect_err(lambda: c.ready(s.session_id, rng(4)), SC.INVALID_ARGUMENT, "TOO_MANY_RANGES",
                       {"count": 4, "max": 2}, "4 ranges over max 2")
            state_is(c.ready(s.session_id, rng(2)), S["READY"], "2 ranges")
            eq(c.stats().pinned_ranges, 2, "pinned")
        with ctx.sub("live limit"):
            eq(c.stats().live_sessions, 3, "live sessions")
            expect_err(lambda: c.allocate(key()), SC.RESOURCE_EXHAUSTED, "TOO_MANY_SESSIONS", {"limit": 3},
                       "a fourth session")
        with ctx.sub("oversized"):
            expect_err(lambda: c.echo(b"\x00" * 70000), (SC.RESOURCE_EXHAUSTED, SC.OUT_OF_RANGE), None,
                       "Echo of 70000 bytes over 65536")
            eq(c.echo(b"x" * 60000).payload, b"x" * 60000, "Echo of 60000 bytes")
        for s in sessions:
            c.release(s.session_id)
        with ctx.sub("max_tombstones"):
            ended = []
            for _ in range(7):
                s = c.allocate(key())
                c.release(s.session_id)
                ended.append(s.session_id)
            st = poll_until(lambda: (lambda x: x if x.tombstones <= 4 else None)(c.stats()), 2.0)
            check(st, f"tombstones {c.stats().tombstones} > max_tombstones 4")
        with ctx.sub("short retention"):
            s = c.allocate(key())
            c.release(s.session_id)
            got = poll_until(lambda: kvconf.refusal_of(lambda: c.get(s.session_id)), 2.5, 0.05)
            check(got is not None and got.reason == "SESSION_NOT_FOUND",
                  f"past a 300 ms retention: {got.describe() if got else 'still answers'}")
        with ctx.sub("clean"):
            st = poll_until(lambda: (lambda x: x if x.pinned_ranges == 0 and x.live_sessions == 0 else None)(
                c.stats()), 2.0)
            check(st, f"not clean: {short(c.stats())}")
        c.close()
    finally:
        srv.kill()


@case("server.capabilities_off", orbite=True)
def server_capabilities_off(ctx):
    """A capability the deployment switches off is advertised as off and
    refused: FAILED_PRECONDITION, CAPABILITY_OFF naming it, nothing
    changes (docs/api.md)."""
    off = own_server(ctx, config={"sessions": {"explicit_release": False, "session_lookup": False}})
    try:
        c = kvconf.Client(off.addr)
        i = c.info()
        eq((i.caller_allocation, i.explicit_release, i.session_lookup), (True, False, False),
           "caller_allocation, explicit_release, session_lookup")
        s = c.allocate("caps-1", lease_ms=60_000)
        before = c.stats()
        expect_err(lambda: c.get(s.session_id), SC.FAILED_PRECONDITION, "CAPABILITY_OFF",
                   {"capability": "session_lookup"}, "get with session_lookup off")
        expect_err(lambda: c.release(s.session_id), SC.FAILED_PRECONDITION, "CAPABILITY_OFF",
                   {"capability": "explicit_release"}, "release with explicit_release off")
        expect_err(lambda: c.release("0000000000000000-1"), SC.FAILED_PRECONDITION, "CAPABILITY_OFF",
                   {"capability": "explicit_release"}, "release of an unknown id: the capability is checked first")
        after = c.stats()
        eq((after.live_sessions, after.tombstones), (before.live_sessions, before.tombstones),
           "live sessions and tombstones after the refusals")
        state_is(c.abort(s.session_id), S["CANCELLED"], "abort of the session the refusals left live")
        c.close()
    finally:
        off.kill()
    no_alloc = own_server(ctx, config={"sessions": {"caller_allocation": False}})
    try:
        c = kvconf.Client(no_alloc.addr)
        eq(c.info().caller_allocation, False, "caller_allocation")
        expect_err(lambda: c.allocate("caps-2"), SC.FAILED_PRECONDITION, "CAPABILITY_OFF",
                   {"capability": "caller_allocation"}, "allocate with caller_allocation off")
        req = c.allocate_req("caps-3")
        req.idempotency_key = ""
        expect_err(lambda: c.allocate(req=req), SC.FAILED_PRECONDITION, "CAPABILITY_OFF",
                   {"capability": "caller_allocation"}, "the capability comes before the fields")
        eq(c.stats().live_sessions, 0, "live sessions after the refusals")
        c.close()
    finally:
        no_alloc.kill()


@case("server.lazy_expiry", orbite=True)
def server_lazy_expiry(ctx):
    """With the reaper slowed to minutes, every call still checks the lease
    itself (docs/api.md, Leases and the reaper) and a tombstone past its
    retention answers NOT_FOUND before anything forgets it."""
    srv = own_server(ctx, config={"reaper_period_ms": 600_000,
                                  "sessions": {"tombstone_retention_ms": 300}})
    try:
        c = kvconf.Client(srv.addr)
        reg = server_regions(c)[0]
        rg = [pb.KvRange(registration=reg.registration, offset=reg.offset, len=kvconf.kv_size())]
        s = c.allocate("lazy-1", lease_ms=200)
        r = c.allocate("lazy-2", lease_ms=200)
        c.ready(r.session_id, rg)
        q = c.allocate("lazy-3", lease_ms=200)
        exp0 = c.stats().sessions_expired
        time.sleep(0.45)
        st = c.stats()
        ctx.note(f"lazy expiry: reaper_ticks {st.reaper_ticks}, sessions_expired {st.sessions_expired - exp0} "
                 f"before any call (0 means the lazy path is what is tested)")
        with ctx.sub("renew after the lease ran out"):
            expect_err(lambda: c.renew(s.session_id, 5000), SC.FAILED_PRECONDITION, "SESSION_ENDED",
                       ended_meta(s.session_id, S["EXPIRED"]), "renew of a lapsed lease")
            g = c.get(s.session_id)
            state_is(g, S["EXPIRED"], "after the late renew")
            eq(g.reason, "lease expired", "reason")
        with ctx.sub("attach after the lease ran out"):
            expect_err(lambda: c.attach(r.session_id), SC.FAILED_PRECONDITION, "SESSION_ENDED",
                       ended_meta(r.session_id, S["EXPIRED"]), "attach of a lapsed lease")
            st = poll_until(lambda: (lambda x: x if x.pinned_ranges == 0 else None)(c.stats()), 2.0)
            check(st, f"pinned_ranges {c.stats().pinned_ranges} after the lapsed session ended")
        with ctx.sub("release after the lease ran out"):
            rel = c.release(q.session_id)
            eq((rel.released_now, rel.state), (False, S["EXPIRED"]), "release of a lapsed lease")
        with ctx.sub("tombstone past retention without a reaper"):
            t = c.allocate("lazy-4", lease_ms=5000)
            c.release(t.session_id)
            time.sleep(0.5)
            expect_err(lambda: c.get(t.session_id), SC.NOT_FOUND, "SESSION_NOT_FOUND",
                       {"session_id": t.session_id}, "get of a tombstone past retention")
            n = c.allocate("lazy-4", lease_ms=5000)
            check(n.session_id != t.session_id, "the key of a forgotten tombstone answered the old session")
            c.release(n.session_id)
        c.close()
    finally:
        srv.kill()


@case("server.restart", orbite=True)
def server_restart(ctx):
    srv = own_server(ctx)
    srv2 = None
    try:
        c = kvconf.Client(srv.addr)
        inc1 = c.info().incarnation
        reg = server_regions(c)[0]
        old = []
        for i in range(3):
            s = c.allocate(f"restart-{i}", lease_ms=60_000)
            old.append(s)
        c.ready(old[0].session_id, [pb.KvRange(registration=reg.registration, offset=reg.offset,
                                               len=kvconf.kv_size())])
        c.complete  # noqa: B018
        port = srv.port()
        c.close()
        srv.kill()
        last = None
        for attempt in range(10):
            try:
                srv2 = kvconf.Server(ctx.orbite, listen=f"127.0.0.1:{port}")
                break
            except Failure as e:
                last = e
                time.sleep(0.3)
        check(srv2 is not None, f"no second server on port {port}: {last}")
        eq(srv2.port(), port, "the second server's port")
        c2 = kvconf.Client(srv2.addr)
        inc2 = c2.info().incarnation
        check(inc2 != inc1, f"the restarted server kept incarnation {inc1}")
        for s in old:
            for op, fn in (("get", lambda: c2.get(s.session_id)), ("release", lambda: c2.release(s.session_id)),
                           ("attach", lambda: c2.attach(s.session_id))):
                with ctx.sub(f"old id {op}"):
                    expect_err(fn, SC.NOT_FOUND, "OTHER_INCARNATION", {"session_id": s.session_id},
                               f"{op} of {s.session_id} on the new incarnation")
        old_ids = {s.session_id for s in old}
        new = []
        for i in range(3):
            n = c2.allocate(f"restart-{i}", lease_ms=60_000)  # the same keys
            new.append(n)
            check(n.session_id not in old_ids, f"new id {n.session_id} reuses an old one")
            check(n.session_id.startswith(inc2 + "-"), f"new id {n.session_id} lacks prefix {inc2}")
        for i in range(20):
            n = c2.allocate(f"restart-more-{i}")
            new.append(n)
            check(n.session_id not in old_ids, f"new id {n.session_id} reuses an old one")
        for n in new:
            c2.release(n.session_id)
        eq(c2.stats().live_sessions, 0, "live after releasing everything")
        c2.close()
        rc, dt = srv2.terminate_and_wait(10)
        eq(rc, 0, "exit status on SIGTERM with nothing live")
        srv2 = None
    finally:
        srv.kill()
        if srv2 is not None:
            srv2.kill()


@case("server.sigterm_drains", orbite=True)
def server_sigterm_drains(ctx):
    bound = 500
    srv = own_server(ctx, config={"drain_timeout_ms": bound})
    try:
        c = kvconf.Client(srv.addr)
        reg = server_regions(c)[0]
        s = c.allocate("sigterm-live", lease_ms=60_000)
        c.ready(s.session_id, [pb.KvRange(registration=reg.registration, offset=reg.offset,
                                          len=kvconf.kv_size())])
        q = c.allocate("sigterm-queued", lease_ms=60_000, style=GF if GF in c.info().supported_styles else CF)
        eq(c.stats().pinned_ranges, 1, "pinned before SIGTERM")
        c.close()
        n_before = len(srv.out.lines)
        rc, dt = srv.terminate_and_wait(bound / 1000 + 10)
        after = srv.out.lines[n_before:]
        ctx.note(f"SIGTERM: exit {rc} after {dt:.2f}s; printed {after!r}")
        check(rc is not None, f"still running {bound / 1000 + 10:.1f}s after SIGTERM")
        eq(rc, 0, "exit status after SIGTERM")
        check(dt <= bound / 1000 + 3.0, f"exited {dt:.2f}s after SIGTERM, drain bound {bound} ms")
        check(after, "printed nothing after SIGTERM (it should say what it did)")
        check(q.session_id, "the queued session")
    finally:
        srv.kill()


# ---------------------------------------------------------------- drain (last)

@case("drain.postcondition", last=True)
def drain_postcondition(ctx):
    c = ctx.client()
    done_req = c.allocate_req(ctx.key("done"), lease_ms=20_000)
    done = c.allocate(req=done_req)
    c.release(done.session_id)
    live_req = c.allocate_req(ctx.key("live"), lease_ms=20_000)
    live, _ = None, None
    live = c.allocate(req=live_req)
    c.ready(live.session_id, ctx.ranges())
    other = c.allocate(ctx.key("other"), lease_ms=20_000)
    base_live = ctx.stats().live_sessions
    # 1. no wait: stops new allocations, reports
    r = c.drain()
    eq(r.drained, False, "drain without timeout, sessions live: drained")
    eq(r.live_sessions, base_live, "drain report live_sessions")
    eq(r.pinned_ranges, 1, "drain report pinned_ranges")
    eq(r.aborted, 0, "drain without abort: aborted")
    st = ctx.stats()
    eq(st.draining, True, "stats.draining")
    state_is(c.get(live.session_id), S["READY"], "a live session goes on while draining")
    expect_err(lambda: c.allocate(ctx.key("new")), SC.UNAVAILABLE, "DRAINING", None, "a new key while draining")
    eq(c.allocate(req=done_req).session_id, done.session_id, "identical retry of an ended session while draining")
    eq(c.allocate(req=live_req).session_id, live.session_id, "identical retry of a live session while draining")
    # 2. wait without abort; one session ends during the wait, one stays
    def release_other():
        with kvconf.Client(ctx.addr) as oc:
            oc.release(other.session_id)
    threading.Timer(0.15, release_other).start()
    t0 = time.monotonic()
    r = c.drain(400, False)
    dt = time.monotonic() - t0
    eq(r.drained, False, "drain(400 ms) with a session still live")
    eq(r.live_sessions, base_live - 1, "live after the wait")
    check(0.3 <= dt <= 3.0, f"drain(400 ms) took {dt:.2f}s")
    state_is(c.get(other.session_id), S["RELEASED"], "the session released during the wait")
    # 3. abort what remains
    t0 = time.monotonic()
    r = c.drain(300, True)
    dt = time.monotonic() - t0
    eq(r.drained, True, f"drain(300 ms, abort) drained ({short(r)})")
    eq((r.live_sessions, r.pinned_ranges, r.tracked_transfers, r.awaiting_cleanup),
       (0, 0, 0, 0), "the drain report")
    eq(r.aborted, base_live - 1, "aborted")
    check(dt <= 3.0, f"drain(300 ms, abort) took {dt:.2f}s")
    g = c.get(live.session_id)
    state_is(g, S["CANCELLED"], "the aborted session")
    st = ctx.stats()
    eq((st.draining, st.live_sessions, st.pinned_ranges, st.tracked_transfers, st.awaiting_cleanup),
       (True, 0, 0, 0, 0), "stats after the drain")
    # 4. irreversible; again is drained at once
    r = c.drain(0, True)
    eq((r.drained, r.aborted), (True, 0), "a second drain")
    expect_err(lambda: c.allocate(ctx.key("after")), SC.UNAVAILABLE, "DRAINING", None,
               "a new key after the drain")
    c.info()


# ================================================================ runner

def check_clean(ctx, baseline_live, timeout=3.0):
    last = [None]

    def ok():
        s = ctx.stats()
        last[0] = s
        return s.live_sessions == baseline_live and s.pinned_ranges == 0 and s.tracked_transfers == 0
    if poll_until(ok, timeout, 0.03):
        return None
    s = last[0]
    return (f"server not left as found: live_sessions {s.live_sessions} (was {baseline_live}), "
            f"pinned_ranges {s.pinned_ranges}, tracked_transfers {s.tracked_transfers}")


def release_all(ctx):
    for sid in list(ctx.created):
        try:
            ctx.admin.release(sid)
        except grpc.RpcError:
            pass


def run_case(ctx, cs):
    ctx.begin(cs.name)
    try:
        baseline = ctx.stats().live_sessions
    except grpc.RpcError as e:
        return "FAIL", f"server does not answer GetKvSessionStats: {kvconf.Refusal(e).describe()}"
    verdict, why = "ok", ""
    try:
        cs.fn(ctx)
        if ctx.soft_failures:
            verdict, why = "FAIL", "; ".join(ctx.soft_failures[:4]) + (
                f" (+{len(ctx.soft_failures) - 4} more)" if len(ctx.soft_failures) > 4 else "")
    except Skip as e:
        verdict, why = "SKIP", str(e)
    except Failure as e:
        fails = [str(e)] + ctx.soft_failures
        verdict, why = "FAIL", "; ".join(fails[:4])
    except grpc.RpcError as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"line {f.lineno}" for f in reversed(tb) if f.filename.endswith("conformance.py")), "")
        verdict, why = "FAIL", f"unexpected {kvconf.Refusal(e).describe()} ({where})"
    except Exception as e:
        fails = [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"] + ctx.soft_failures
        verdict, why = "FAIL", "; ".join(fails[:4])
    # Leave the server as found: a passing case must have cleaned up itself.
    try:
        dirty = check_clean(ctx, baseline, timeout=3.0 if verdict == "ok" else 0.2)
        if dirty:
            release_all(ctx)
            if verdict == "ok":
                verdict, why = "FAIL", dirty
            else:
                dirty = check_clean(ctx, baseline)
                if dirty:
                    why += f"; {dirty}"
    except grpc.RpcError as e:
        if verdict != "SKIP":
            verdict, why = "FAIL", (why + "; " if why else "") + \
                f"server stopped answering: {kvconf.Refusal(e).describe()}"
    ctx.end()
    return verdict, why


def main():
    global pb
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("addr")
    ap.add_argument("--orbite", help="the orbite binary, to start servers of its own (restart, SIGTERM)")
    ap.add_argument("--only", action="append", default=[], help="run cases whose name contains this")
    ap.add_argument("--proto", default=os.path.normpath(os.path.join(HERE, "..", "..", "proto")))
    ap.add_argument("--stubs", help="generate the stubs here (default: a temporary directory)")
    args = ap.parse_args()
    kvconf.install_signal_cleanup()
    import shutil
    import tempfile
    stub_dir = args.stubs or tempfile.mkdtemp(prefix="kv-conformance-stubs-")
    try:
        try:
            kvconf.generate_stubs(args.proto, stub_dir)
        except Exception as e:
            print(f"FAIL setup: cannot generate the stubs from {args.proto}: {e}")
            print("session conformance: 0 passed, 1 failed")
            return 1
        pb = kvconf.pb
        for name, v in pb.KvSessionState.items():
            S[name.replace("KV_SESSION_STATE_", "")] = v
        if args.orbite and not os.access(args.orbite, os.X_OK):
            print(f"FAIL setup: --orbite {args.orbite} is not an executable")
            print("session conformance: 0 passed, 1 failed")
            return 1
        try:
            ctx = Ctx(args.addr, args.orbite, stub_dir, f"{random.getrandbits(32):08x}")
        except grpc.RpcError as e:
            print(f"FAIL connect: {args.addr} does not answer GetKvConnectorInfo/GetKvSessionStats: "
                  f"{kvconf.Refusal(e).describe()}")
            print("session conformance: 0 passed, 1 failed")
            return 1
        reg = max(ctx.regions, key=lambda r: r.len) if ctx.regions else None
        if reg is not None and reg.len < 4 * 4096:
            kvconf.set_default_meta(max(1, reg.len // 4), 4)
        cases = [c for c in CASES if not c.last] + [c for c in CASES if c.last]
        if args.only:
            cases = [c for c in cases if any(o in c.name for o in args.only)]
        passed = failed = 0
        t_all = time.monotonic()
        for cs in cases:
            t0 = time.monotonic()
            verdict, why = run_case(ctx, cs)
            dt = time.monotonic() - t0
            if verdict == "ok":
                passed += 1
                print(f"ok {cs.name}", flush=True)
            elif verdict == "SKIP":
                print(f"SKIP {cs.name}: {why}", flush=True)
            else:
                failed += 1
                print(f"FAIL {cs.name}: {why}", flush=True)
            for n in ctx.notes:
                print(f"    # {n}", file=sys.stderr, flush=True)
            print(f"    # {cs.name}: {dt:.2f}s", file=sys.stderr, flush=True)
        print(f"    # total {time.monotonic() - t_all:.1f}s", file=sys.stderr, flush=True)
        print(f"session conformance: {passed} passed, {failed} failed", flush=True)
        return 0 if failed == 0 else 1
    finally:
        kvconf._kill_children()
        if not args.stubs:
            shutil.rmtree(stub_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
