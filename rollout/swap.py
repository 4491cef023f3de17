"""Which policy version a rollout worker serves, and when that changes: a pure state machine (no I/O,
no threads, no clock: the caller passes the time, runs the fetches and installs the versions;
VersionSwap lists its calls).

Rules:
1. Forward only, ours only. A pointer not newer than the live version (a restarted trainer) is not
   fetched; nor is a version refused before, a (version, source, digest) whose source served other
   content, or a contract fingerprint not ours (counted and logged once per version). Either way the
   pending fetch is dropped (`Step.cancel`) and groups start again under the live version.
2. One fetch at a time. The pointer of the pending fetch keeps it; another supersedes it (cancelled,
   then its own starts), except while a failed fetch waits for its retry (`retry_s` after the failure).
3. Drain, then swap (default). While a fetch is pending no group starts ("drain"); a fetched version
   is installed only once no started group is in flight ("install"), and is then live.
3'. In flight (`inflight=True`, loop.inflight_updates). Groups keep starting while fetching ("wait");
   a fetched version is installed as soon as it is fetched, between two decode steps, whatever is
   in flight ("install"): unfinished samples continue under it.
4. A fetch or install that failed ends the pending fetch; groups start again under the live version;
   the error decides whether the version is refused, its source distrusted or the fetch retried (`fail`).
5. A live version whose activations or logits turn non-finite is refused as at fetch: nothing is live
   until a newer version is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import grpc

from broker.policy_client import FetchCancelled
from broker.registry import PolicyPointer
from policy import manifest as mf
from policy.chunks import ChecksumMismatch
from policy.manifest_check import ManifestRefused

__all__ = ["Pending", "Step", "VersionSwap", "why"]


@dataclass(frozen=True)
class Step:
    """What the caller does after `offer`, in this order: log `line` (if any); if `cancel`, drop the
    pending fetch (stop it if it runs, and wait for it to let go of the host buffers); then `action`:
    "fetch" start fetching the offered pointer under `ticket` (and, draining on swap, stop starting
    groups); "drain" stop starting groups; "install" install the fetched version now (then
    `went_live`, or `fail`); "resume" start groups again under the live version; "wait" nothing."""

    action: str
    cancel: bool = False
    line: str | None = None
    ticket: int = 0


@dataclass(frozen=True)
class Pending:
    """The version being fetched (done: its fetch ended; error: what it raised)."""

    pointer: PolicyPointer
    ticket: int
    seen: float  # the caller's clock when its fetch started
    done: bool = False
    error: BaseException | None = None


class VersionSwap:
    """The state machine of the module docstring. `live`: the version in use (None before the first);
    `pending`: the fetch in progress or fetched; counts for the metrics: `versions_refused`,
    `sources_distrusted`, `fetch_failures`; `inflight`: rule 3' instead of 3:

        s = VersionSwap(fingerprint=fp, policy_address=None, retry_s=0.5, inflight=False)
        s.offer(pointer, now=t, drained=d) -> Step    the newest signed pointer: what to do now
        s.fetch_done(ticket, error)                    the fetch a "fetch" step started has ended
        s.went_live() -> Pending / s.fail(error, now=t) the caller installed the fetched version / it raised
        s.refuse_live(); s.unload()                    the live version computed non-finite values / is gone
        s.distrust(pointer, relay)                     a relay served other content (the fetch fell back)
    """

    def __init__(
        self, *, fingerprint: str, policy_address: str | None = None, retry_s: float = 0.5, inflight: bool = False
    ):
        self.fingerprint, self.policy_address, self.retry_s = fingerprint, policy_address, retry_s
        self.inflight = inflight
        self.live: int | None = None
        self.pending: Pending | None = None
        self.refused_versions: set[int] = set()  # immutable versions: never fetched again
        self.distrusted: set[tuple[int, str, str]] = set()  # (version, source, content digest)
        self.versions_refused = self.sources_distrusted = self.fetch_failures = 0
        self._foreign: int | None = None  # the last version refused for its fingerprint (logged once)
        self._failed_at: float | None = None  # when the last retried failure happened
        self._error = ""  # the last failure logged (`why`), until a version goes live
        self._tickets = 0

    @property
    def fetched(self) -> bool:
        """The pending fetch has ended (fetched, or failed: `offer` says what next)."""
        return self.pending is not None and self.pending.done

    def source(self, pointer: PolicyPointer) -> str:
        """Where `pointer`'s version is fetched from: the configured address, else the pointer's."""
        return self.policy_address or pointer.address

    def offer(self, pointer: PolicyPointer, *, now: float, drained: bool) -> Step:
        """What to do about the newest pointer (rules 1-4); `drained`: no started group is in flight
        (unused in flight: rule 3')."""
        p = self.pending
        line = self._refusal(pointer)
        if line is not None:
            self.pending = None
            return Step("resume", cancel=p is not None, line=line or None)
        if p is not None and p.pointer == pointer:
            if p.error is not None:
                return Step("resume", cancel=True, line=self.fail(p.error, now=now))
            if self.inflight:
                return Step("install" if p.done else "wait")
            return Step("install" if p.done and drained else "drain")
        if self._failed_at is not None and now < self._failed_at + self.retry_s:
            return Step("wait")
        self._tickets += 1
        self.pending = Pending(pointer, self._tickets, seen=now)
        if p is not None:
            done = "fetched" if p.done else "fetching"
            line = f"v{pointer.version} announced while {done} v{p.pointer.version}: superseded"
        return Step("fetch", cancel=p is not None, line=line, ticket=self._tickets)

    def fetch_done(self, ticket: int, error: BaseException | None = None) -> None:
        """The fetch started under `ticket` ended (a superseded one's end is ignored)."""
        if self.pending is not None and self.pending.ticket == ticket:
            self.pending = dataclasses.replace(self.pending, done=True, error=error)

    def went_live(self) -> Pending:
        """The pending version was installed: it is live. Returns what was pending."""
        p, self.pending = self.pending, None
        self.live, self._error = p.pointer.version, ""
        return p

    def fail(self, error: BaseException, *, now: float) -> str | None:
        """The pending version did not load (rule 4): the line to log, None for none. Raises `error`
        when rule 4 does not know it. ManifestRefused (this contract cannot load it) refuses the
        version for good; a manifest of another digest, or bytes failing an authenticated manifest,
        distrusts that source for that version; other gRPC, value and OS errors are retried `retry_s`
        later, counted each time, logged when the error is not the last one logged; a cancelled
        fetch is no news; anything else is raised."""
        p, self.pending = self.pending, None
        pointer = p.pointer
        if isinstance(error, ManifestRefused):
            self.refused_versions.add(pointer.version)
            self.versions_refused += 1
            return f"{str(error)[:400]}; keeping v{self.live} ({len(self.refused_versions)} version(s) refused)"
        # Without a digest in the pointer, bytes failing their manifest prove nothing about the source.
        if isinstance(error, mf.DigestMismatch) or (isinstance(error, ChecksumMismatch) and pointer.content_digest):
            source = self.source(pointer)
            self.distrusted.add((pointer.version, source, pointer.content_digest))
            self.sources_distrusted += 1
            return (
                f"refusing v{pointer.version} from {source}: {why(error)}; not asking it for "
                f"v{pointer.version} again, keeping v{self.live}"
            )
        if isinstance(error, FetchCancelled):
            return None
        if not isinstance(error, (grpc.RpcError, ValueError, OSError)):
            raise error
        self.fetch_failures += 1
        self._failed_at = now
        if why(error) == self._error:
            return None
        self._error = why(error)
        return (
            f"fetching v{pointer.version} from {self.source(pointer)} failed, "
            f"will retry (the same error again is not logged): {why(error)}"
        )

    def distrust(self, pointer: PolicyPointer, source: str) -> None:
        """A relay `source` served other content than `pointer` names: not asked for that version
        again (rollout/sources.py leaves it out), counted with the distrusted sources. Called from the
        fetch thread: one set.add, which the GIL makes atomic against the loop's membership tests."""
        self.distrusted.add((pointer.version, source, pointer.content_digest))
        self.sources_distrusted += 1

    def refuse_live(self) -> int | None:
        """The live version computed non-finite values (rule 5): refused, nothing live. Returns it."""
        v, self.live = self.live, None
        self.refused_versions.add(v)
        self.versions_refused += 1
        return v

    def unload(self) -> None:
        """What held the live version is gone (an engine being rebuilt): nothing is live."""
        self.live = None

    def _refusal(self, pointer: PolicyPointer) -> str | None:
        """Rule 1: None when `pointer` is to be fetched, else the line to log ("" for none)."""
        if self.live is not None and pointer.version <= self.live:
            return ""
        if pointer.version in self.refused_versions:
            return ""
        if (pointer.version, self.source(pointer), pointer.content_digest) in self.distrusted:
            return ""  # wait for another source: a new pointer (a newer version, or this one elsewhere)
        if pointer.contract_fingerprint == self.fingerprint:
            return None
        if pointer.version == self._foreign:
            return ""
        self._foreign = pointer.version
        self.versions_refused += 1
        return (
            f"refusing v{pointer.version}: contract fingerprint {pointer.contract_fingerprint[:12]} "
            f"is not ours ({self.fingerprint[:12]})"
        )


def why(e: BaseException) -> str:
    """One line for a log: a gRPC error's status code and details (its str() is a multi-line
    dump whose first line says nothing), else the exception's type and first line."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        details = (e.details() or "").replace("\n", " ")
        return f"gRPC {e.code().name}: {details[:300]}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
