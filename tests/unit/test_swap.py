"""rollout.swap: the worker's version swap (announce -> fetch -> drain -> live; superseded, refused,
distrusted, retried versions), driven by hand with the errors a fetch raises (no fetch, no engine)."""

from __future__ import annotations

import grpc
import pytest

from broker.policy_client import FetchCancelled
from broker.registry import PolicyPointer
from policy import manifest as mf
from policy.chunks import ChecksumMismatch
from policy.manifest_check import ManifestRefused
from rollout.swap import Step, VersionSwap

FP = "f" * 64
D2 = "2" * 64  # a content digest


def ptr(v: int, address: str = "trainer:1", *, fp: str = FP, digest: str = "") -> PolicyPointer:
    return PolicyPointer(version=v, address=address, contract_fingerprint=fp, content_digest=digest)


def live_at(version: int, **kw) -> VersionSwap:
    """A machine with `version` live (fetched and installed while idle)."""
    s = VersionSwap(fingerprint=FP, **kw)
    step = s.offer(ptr(version), now=0.0, drained=True)
    s.fetch_done(step.ticket)
    assert s.offer(ptr(version), now=0.0, drained=True) == Step("install")
    assert s.went_live().pointer == ptr(version) and s.live == version and s.pending is None
    return s


def test_announce_fetch_drain_install():
    s = VersionSwap(fingerprint=FP)
    assert s.live is None and s.pending is None and not s.fetched
    assert s.offer(ptr(1), now=10.0, drained=True) == Step("fetch", ticket=1)
    assert s.pending.pointer == ptr(1) and s.pending.seen == 10.0 and not s.fetched
    assert s.offer(ptr(1), now=11.0, drained=True) == Step("drain")  # still fetching: the same fetch
    s.fetch_done(1)
    assert s.fetched
    # Fetched, but a started group is in flight: keep draining; once drained, install.
    assert s.offer(ptr(1), now=12.0, drained=False) == Step("drain")
    assert s.offer(ptr(1), now=13.0, drained=True) == Step("install")
    assert s.went_live().seen == 10.0
    assert s.live == 1 and s.pending is None
    assert (s.versions_refused, s.sources_distrusted, s.fetch_failures) == (0, 0, 0)


def test_a_newer_pointer_supersedes_the_pending_fetch_and_the_old_fetch_end_is_ignored():
    s = live_at(1)
    a = s.offer(ptr(2), now=0.0, drained=False)
    assert a.action == "fetch" and not a.cancel and a.line is None
    b = s.offer(ptr(3), now=0.0, drained=False)
    assert b == Step("fetch", cancel=True, line="v3 announced while fetching v2: superseded", ticket=a.ticket + 1)
    s.fetch_done(a.ticket)  # v2's fetch ends late: not v3's
    assert s.pending.pointer == ptr(3) and not s.fetched
    s.fetch_done(b.ticket)
    c = s.offer(ptr(4), now=0.0, drained=False)
    assert c.cancel and c.line == "v4 announced while fetched v3: superseded"


def test_forward_only_a_pointer_that_went_back_drops_the_pending_fetch():
    s = live_at(3)
    s.offer(ptr(4), now=0.0, drained=False)
    assert s.offer(ptr(2), now=0.0, drained=False) == Step("resume", cancel=True)  # a restarted trainer
    assert s.pending is None and s.live == 3
    assert s.offer(ptr(3), now=0.0, drained=True) == Step("resume")  # nothing pending: nothing to cancel


def test_a_foreign_fingerprint_is_refused_counted_and_logged_once_per_version_and_drops_the_fetch():
    s = live_at(1)
    s.offer(ptr(2), now=0.0, drained=False)
    step = s.offer(ptr(3, fp="0" * 64), now=0.0, drained=False)
    assert step.action == "resume" and step.cancel and s.pending is None
    assert step.line == f"refusing v3: contract fingerprint {'0' * 12} is not ours ({'f' * 12})"
    assert s.offer(ptr(3, fp="0" * 64), now=0.0, drained=False) == Step("resume")  # not logged again
    assert s.versions_refused == 1
    assert s.offer(ptr(4, fp="0" * 64), now=0.0, drained=False).line.startswith("refusing v4")
    assert s.versions_refused == 2 and s.refused_versions == set()  # a pointer, not the version's content


def test_a_refused_manifest_refuses_the_version_for_good():
    s = live_at(1)
    t = s.offer(ptr(2), now=0.0, drained=True).ticket
    s.fetch_done(t, ManifestRefused("policy version 2 refused: a tensor this contract does not have"))
    step = s.offer(ptr(2), now=0.0, drained=True)
    assert step == Step(
        "resume",
        cancel=True,
        line="policy version 2 refused: a tensor this contract does not have; keeping v1 (1 version(s) refused)",
    )
    assert s.refused_versions == {2} and s.versions_refused == 1 and s.pending is None
    assert s.offer(ptr(2), now=100.0, drained=True) == Step("resume")  # never fetched again, not logged
    assert s.offer(ptr(2, "relay:2"), now=100.0, drained=True) == Step("resume")  # from nowhere
    assert s.offer(ptr(3), now=100.0, drained=True).action == "fetch"


def test_other_content_than_the_pointer_names_distrusts_that_source_for_that_version():
    s = live_at(1)
    t = s.offer(ptr(2, digest=D2), now=0.0, drained=True).ticket
    s.fetch_done(t, mf.DigestMismatch("manifest digest ab.. is not the pointer's"))
    step = s.offer(ptr(2, digest=D2), now=0.0, drained=True)
    assert step.line == (
        "refusing v2 from trainer:1: DigestMismatch: manifest digest ab.. is not the pointer's; "
        "not asking it for v2 again, keeping v1"
    )
    assert s.distrusted == {(2, "trainer:1", D2)} and s.sources_distrusted == 1
    assert s.offer(ptr(2, digest=D2), now=0.0, drained=True) == Step("resume")  # not asked again
    # The same version elsewhere is fetched; bytes failing an authenticated manifest distrust it too.
    t = s.offer(ptr(2, "relay:2", digest=D2), now=0.0, drained=True).ticket
    s.fetch_done(t, ChecksumMismatch("chunk 3 of w: xxh3 mismatch"))
    assert s.offer(ptr(2, "relay:2", digest=D2), now=0.0, drained=True).line.startswith("refusing v2 from relay:2")
    assert s.sources_distrusted == 2 and s.refused_versions == set() and s.fetch_failures == 0


def test_a_configured_policy_address_is_the_source():
    s = VersionSwap(fingerprint=FP, policy_address="relay:9")
    assert s.source(ptr(1, "trainer:1")) == "relay:9"
    t = s.offer(ptr(1, digest=D2), now=0.0, drained=True).ticket
    s.fetch_done(t, mf.DigestMismatch("other digest"))
    s.offer(ptr(1, digest=D2), now=0.0, drained=True)
    assert s.distrusted == {(1, "relay:9", D2)}


def test_a_failed_fetch_is_retried_after_retry_s_counted_each_time_and_logged_when_new():
    s = live_at(1, retry_s=0.5)
    dead = ptr(2, "127.0.0.1:1")
    t = s.offer(dead, now=10.0, drained=False).ticket
    s.fetch_done(t, ValueError("connection refused at 127.0.0.1:1"))
    step = s.offer(dead, now=10.1, drained=False)  # logged at once, not after the drain
    assert step == Step(
        "resume",
        cancel=True,
        line="fetching v2 from 127.0.0.1:1 failed, will retry (the same error again is not logged): "
        "ValueError: connection refused at 127.0.0.1:1",
    )
    assert s.fetch_failures == 1 and s.pending is None and s.live == 1
    assert s.offer(dead, now=10.4, drained=False) == Step("wait")  # 0.5 s after the failure
    assert s.offer(ptr(3), now=10.59, drained=False) == Step("wait")  # whichever version
    t = s.offer(dead, now=10.6, drained=False).ticket
    s.fetch_done(t, ValueError("connection refused at 127.0.0.1:1"))
    assert s.offer(dead, now=10.7, drained=False) == Step("resume", cancel=True)  # the same error: counted only
    assert s.fetch_failures == 2
    s.retry_s = 0.0  # due at once
    t = s.offer(dead, now=10.7, drained=False).ticket
    s.fetch_done(t, OSError("no route"))
    assert s.offer(dead, now=10.8, drained=False).line.endswith("OSError: no route")
    # A checksum mismatch without a digest in the pointer proves nothing about the source: retried.
    t = s.offer(ptr(2), now=11.0, drained=False).ticket
    s.fetch_done(t, ChecksumMismatch("chunk 0: xxh3 mismatch"))
    assert "will retry" in s.offer(ptr(2), now=11.0, drained=False).line and s.distrusted == set()
    assert s.fetch_failures == 4


def test_grpc_errors_are_one_line_and_a_success_forgets_the_last_error():
    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect\nto all addresses"

    s = live_at(1, retry_s=0.0)
    for v in (2, 2):
        t = s.offer(ptr(v), now=0.0, drained=True).ticket
        s.fetch_done(t, Unavailable())
        s.offer(ptr(v), now=0.0, drained=True)
    t = s.offer(ptr(2), now=0.0, drained=True).ticket
    s.fetch_done(t)
    assert s.offer(ptr(2), now=0.0, drained=True) == Step("install")
    s.went_live()
    t = s.offer(ptr(3), now=0.0, drained=True).ticket
    s.fetch_done(t, Unavailable())
    line = s.offer(ptr(3), now=0.0, drained=True).line  # logged again: the last error was forgotten
    assert line.endswith("gRPC UNAVAILABLE: failed to connect to all addresses")
    assert s.fetch_failures == 3


def test_an_install_that_raises_fails_like_a_fetch_and_unknown_errors_are_raised():
    s = live_at(1)
    t = s.offer(ptr(2), now=0.0, drained=True).ticket
    s.fetch_done(t)
    assert s.offer(ptr(2), now=0.0, drained=True) == Step("install")
    s.unload()  # the engine was freed to build a fresh one, and building it raised
    assert "keeping vNone" in s.fail(ManifestRefused("v2: no engine for it"), now=0.0)
    assert s.live is None and s.pending is None and s.refused_versions == {2}
    t = s.offer(ptr(3), now=0.0, drained=True).ticket
    s.fetch_done(t, FetchCancelled())
    assert s.offer(ptr(3), now=0.0, drained=True) == Step("resume", cancel=True)  # no news, not counted
    t = s.offer(ptr(3), now=0.0, drained=True).ticket
    s.fetch_done(t, RuntimeError("CUDA error: out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        s.offer(ptr(3), now=0.0, drained=True)
    assert s.pending is None and s.fetch_failures == 0


def test_a_live_version_refused_while_generating_is_never_fetched_again():
    s = live_at(5)
    assert s.refuse_live() == 5
    assert s.live is None and s.refused_versions == {5} and s.versions_refused == 1
    assert s.offer(ptr(5), now=0.0, drained=True) == Step("resume")
    assert s.offer(ptr(6), now=0.0, drained=True).action == "fetch"


# ------------------------------------------------------------------ in flight (loop.inflight_updates)


def test_in_flight_groups_keep_starting_while_fetching_and_the_version_installs_as_soon_as_fetched():
    s = VersionSwap(fingerprint=FP, inflight=True)
    assert s.offer(ptr(1), now=0.0, drained=True) == Step("fetch", ticket=1)
    s.fetch_done(1)
    assert s.offer(ptr(1), now=0.0, drained=True) == Step("install")
    s.went_live()
    assert s.offer(ptr(2), now=1.0, drained=False) == Step("fetch", ticket=2)
    assert s.offer(ptr(2), now=1.1, drained=False) == Step("wait")  # fetching: no drain, groups start
    s.fetch_done(2)
    assert s.offer(ptr(2), now=1.2, drained=False) == Step("install")  # groups in flight: installed anyway
    assert s.went_live().pointer == ptr(2) and s.live == 2 and s.pending is None


def test_in_flight_a_newer_pointer_supersedes_and_a_failure_resumes_as_when_draining():
    s = VersionSwap(fingerprint=FP, inflight=True)
    s.offer(ptr(1), now=0.0, drained=True)
    s.fetch_done(1)
    assert s.offer(ptr(1), now=0.0, drained=False) == Step("install")
    s.went_live()
    a = s.offer(ptr(2), now=0.0, drained=False)
    b = s.offer(ptr(3), now=0.0, drained=False)
    assert b == Step("fetch", cancel=True, line="v3 announced while fetching v2: superseded", ticket=a.ticket + 1)
    s.fetch_done(b.ticket, grpc.RpcError())
    step = s.offer(ptr(3), now=5.0, drained=False)
    assert step.action == "resume" and step.cancel and s.live == 1 and s.fetch_failures == 1
    assert s.offer(ptr(3), now=5.1, drained=False) == Step("wait")  # retried retry_s after the failure
    assert s.offer(ptr(3), now=5.6, drained=False).action == "fetch"
