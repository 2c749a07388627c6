"""What a tree will serve, as one string: the fingerprint nodes of a cluster compare.

Every node of a tensor-parallel deployment must run the same patched code: one
rank without an opt-in, or on another vLLM build, deadlocks or answers wrongly
(../README.md, "Clusters"). The fingerprint is made of

- vLLM's release and build (its version, and the METADATA and WHEEL pip
  installed it with: requirements, pins and platform tag),
- FlashInfer's version and whether it is installed or only pinned,
- the opt-ins the tree was asked for,
- each patch's verdict,
- the sha256 of every file the judgement read (the files patches edit and those
  they judge from, whichever they are in this release),

and of nothing that depends on where or when the tree was installed. The text:

    dsv4:1:HEAD:vllm-VERSION:fi-VERSION[-pinned]:BUILD+OPTINS:PATCHES:FILES

``1`` is the format; HEAD (12 base32 characters) is the hash of all of it:
equal heads, equal trees. The rest is there to say what differs: the versions
in clear, then 4-character tokens (base32, 20 bits): the build's and the
opt-ins', one per patch (its id and verdict), one per file (its path and
sha256). A node that knows its own parts matches them against another's
tokens, so it can name the patch or the file that differs.

Imported by verify's fast path and by the serve guard: plain classes, no
dataclasses or typing, and nothing of verify's fast path (patch_dsv4.fastpath.quick
imports this module, when it has a fingerprint to make). Files are read with
:mod:`patch_dsv4.tree.installed`, hashed with hashlib, and the canonical text
written with json.
"""

import os
import sys

from patch_dsv4.tree.installed import METADATA_LIMIT, WHEEL_LIMIT, read_file

FORMAT = 1
PREFIX = "dsv4"
ENV_WITH = "PATCH_DSV4_WITH"
ENV_EXPECT = "PATCH_DSV4_EXPECT"
_TOKEN = 4
_HEAD = 12
#: The verdicts a token is tried against when naming another node's verdict (render's and verdicts' values).
VERDICTS = ("applied", "pending", "upstream", "not-applicable", "drifted", "modified", "opt-in", "foreign")


def sha256(data: bytes = b""):
    import hashlib

    return hashlib.sha256(data)


def dumps(value) -> str:
    """The canonical JSON text of ``value``: sorted keys, no blanks (what HEAD hashes)."""
    import json

    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class BadFingerprint(ValueError):
    """Text that is not a fingerprint this patch-dsv4 can read."""


_BASE32 = "abcdefghijklmnopqrstuvwxyz234567"


def _b32(digest: bytes, length: int) -> str:
    """The first ``length`` characters of ``digest`` in lowercase base32 (RFC 4648), without importing base64
    (about 1 ms in every vLLM process)."""
    bits = len(digest) * 8
    number = int.from_bytes(digest, "big")
    return "".join(_BASE32[(number >> (bits - 5 * (i + 1))) & 31] for i in range(length))


def _token(*parts: str) -> str:
    return _b32(sha256("\0".join(parts).encode()).digest()[:5], _TOKEN)


def _shown_version(version: str | None) -> str:
    """A version as the text shows it: the characters that cannot break the format (the hash has the rest)."""
    if not version:
        return "none"
    return "".join(c if c.isalnum() or c in ".+!" else "." for c in version)


def build_identity(dist_info: str | None, metadata: bytes | None = None) -> str | None:
    """The sha256 of vLLM's METADATA and WHEEL as pip installed them (copied from the wheel, the same on every
    install of one build); None when the dist-info directory is unknown. ``metadata``: METADATA's bytes where they
    were read already. A file that is absent counts as empty; one that is not a regular file, or larger than its
    format needs, is Unreadable (patch_dsv4.tree.installed): read whole, or not at all."""
    if not dist_info:
        return None
    digest = sha256()
    for name, limit in (("METADATA", METADATA_LIMIT), ("WHEEL", WHEEL_LIMIT)):
        data = metadata if name == "METADATA" and metadata is not None else None
        if data is None:
            shown = f"{os.path.basename(dist_info)}/{name}"
            try:
                data = read_file(os.path.join(dist_info, name), limit, f"a {name}", shown)
            except FileNotFoundError:
                data = b""
        digest.update(name.encode() + b"\0" + sha256(data).digest())
    return digest.hexdigest()


class Fingerprint:
    """The parts of what a tree serves, and their text (:attr:`text`)."""

    __slots__ = ("vllm_version", "build", "flashinfer_version", "flashinfer_source", "opt_in", "verdicts", "files")

    def __init__(
        self,
        vllm_version: str,
        build: str | None,
        flashinfer_version: str | None,
        flashinfer_source: str | None,
        opt_in,
        verdicts: dict,
        files: dict,
    ) -> None:
        self.vllm_version, self.build = vllm_version, build
        self.flashinfer_version, self.flashinfer_source = flashinfer_version, flashinfer_source
        self.opt_in = tuple(sorted(set(opt_in)))
        self.verdicts = dict(sorted(verdicts.items()))  # patch id -> verdict
        self.files = dict(sorted(files.items()))  # relative path -> sha256 (None: absent or unreadable)

    def canonical(self) -> str:
        """Every part, in one JSON text: what HEAD hashes."""
        return dumps(
            {
                "format": FORMAT,
                "vllm": [self.vllm_version, self.build],
                "flashinfer": [self.flashinfer_version, self.flashinfer_source],
                "opt_in": self.opt_in,
                "verdicts": self.verdicts,
                "files": self.files,
            }
        )

    def _flashinfer_text(self) -> str:
        if not self.flashinfer_version:
            return "fi-none"
        pinned = "-pinned" if self.flashinfer_source == "pinned" else ""
        return f"fi-{_shown_version(self.flashinfer_version)}{pinned}"

    def _build_token(self) -> str:
        return _token("build", self.vllm_version, self.build or "")

    @property
    def head(self) -> str:
        """HEAD: the hash of every part (equal heads, equal trees)."""
        return _b32(sha256(self.canonical().encode()).digest(), _HEAD)

    @property
    def text(self) -> str:
        return ":".join(
            (
                PREFIX,
                str(FORMAT),
                self.head,
                f"vllm-{_shown_version(self.vllm_version)}",
                self._flashinfer_text(),
                self._build_token() + _opt_in_token(self.opt_in),
                "".join(_token("patch", pid, v) for pid, v in self.verdicts.items()),
                "".join(_token("file", rel, sha or "") for rel, sha in self.files.items()),
            )
        )

    def __str__(self) -> str:
        return self.text

    def differences(self, expected: str) -> list[str]:
        """What differs between this tree and the one whose fingerprint is ``expected``; [] when they are equal.

        BadFingerprint when ``expected`` is not a fingerprint (or one of another format).
        """
        there = Parsed(expected)
        if there.head == self.head:
            return []  # the tokens, one hash each, only where there is something to name
        here = Parsed(self.text)
        found = []
        if there.vllm != here.vllm:
            found.append(f"vLLM {there.vllm} there, {here.vllm} here")
        elif there.build != here.build:
            found.append(f"vLLM build: another {here.vllm} build there (its METADATA or WHEEL differs)")
        if there.flashinfer != here.flashinfer:
            found.append(f"FlashInfer {there.flashinfer} there, {here.flashinfer} here")
        if there.opt_in != here.opt_in:
            theirs = _opt_ins_of(there.opt_in, self.verdicts)
            said = ", ".join(theirs) if theirs is not None else None
            mine = ", ".join(self.opt_in) or "none"
            found.append(
                f"opt-ins: {said or 'none'} there, {mine} here"
                if said is not None
                else f"opt-ins: {mine} here, others there"
            )
        for pid, verdict in self.verdicts.items():
            if _token("patch", pid, verdict) in there.patches:
                continue
            theirs = next((v for v in VERDICTS if _token("patch", pid, v) in there.patches), None)
            found.append(f"{pid}: {theirs or 'not judged'} there, {verdict} here")
        if len(there.patches) > len(here.patches):
            found.append(f"{len(there.patches) - len(here.patches)} patch(es) there that this patch-dsv4 does not know")
        differing = [rel for rel, sha in self.files.items() if _token("file", rel, sha or "") not in there.files]
        if differing and there.build != here.build:  # another release or build: its files differ
            return [*found, f"{len(differing)} of the {len(self.files)} files judged from differ"]
        for rel in differing:
            sha = self.files[rel]
            found.append(f"{rel}: {'absent here' if sha is None else 'another sha256 there (or absent there)'}")
        extra = len(there.files) - (len(here.files) - len(differing))
        if extra > len(differing):
            found.append(f"{extra - len(differing)} more file(s) judged from there than here")
        if not found:
            found.append("the trees differ in a part this fingerprint cannot name (compare `status --json`)")
        return found


def _opt_in_token(opt_in) -> str:
    return _token("opt-in", *sorted(opt_in))


def _opt_ins_of(token: str, patch_ids) -> tuple[str, ...] | None:
    """The opt-ins behind ``token``, tried among the subsets of ``patch_ids``; None when none gives it."""
    import itertools

    ids = sorted(patch_ids)
    for size in range(len(ids) + 1):
        for subset in itertools.combinations(ids, size):
            if _opt_in_token(subset) == token:
                return subset
    return None


class Parsed:
    """A fingerprint's text, split into its parts (nothing of the tree behind it)."""

    __slots__ = ("head", "vllm", "flashinfer", "build", "opt_in", "patches", "files")

    def __init__(self, text: str) -> None:
        parts = text.strip().split(":")
        if len(parts) != 8 or parts[0] != PREFIX:
            raise BadFingerprint(f"{text.strip()[:60]!r} is not a patch-dsv4 fingerprint")
        if parts[1] != str(FORMAT):
            raise BadFingerprint(f"a fingerprint of format {parts[1]}; this patch-dsv4 reads format {FORMAT}")
        head, vllm, flashinfer, ids, patches, files = parts[2:]
        if (
            len(head) != _HEAD
            or not vllm.startswith("vllm-")
            or not flashinfer.startswith("fi-")
            or len(ids) != 2 * _TOKEN
            or len(patches) % _TOKEN
            or len(files) % _TOKEN
        ):
            raise BadFingerprint(f"{text.strip()[:60]!r} is not a whole patch-dsv4 fingerprint (was it cut?)")
        self.head = head
        self.vllm = vllm[len("vllm-") :]
        self.flashinfer = flashinfer[len("fi-") :]
        self.build, self.opt_in = ids[:_TOKEN], ids[_TOKEN:]
        self.patches = {patches[i : i + _TOKEN] for i in range(0, len(patches), _TOKEN)}
        self.files = {files[i : i + _TOKEN] for i in range(0, len(files), _TOKEN)}


def equal(text: str, expected: str) -> bool:
    """Whether two fingerprints' texts name one tree (their heads); BadFingerprint when one is not a fingerprint."""
    return Parsed(text).head == Parsed(expected).head


# -- opt-ins asked for without arguments ---------------------------------------------------
def opt_ins_from_env(environ=None) -> list[str]:
    """The opt-in patch ids ``PATCH_DSV4_WITH`` names (comma- or space-separated), in order, each once."""
    value = (os.environ if environ is None else environ).get(ENV_WITH, "")
    return list(dict.fromkeys(part for part in value.replace(",", " ").split() if part))


def unknown_opt_ins(asked, known_opt_ins) -> list[str]:
    """The ids of ``asked`` that are no opt-in patch."""
    return [pid for pid in asked if pid not in set(known_opt_ins)]


# -- the fingerprint of a tree, from what a command judged ---------------------------------
def dist_info_of(env) -> str | None:
    """The dist-info directory of an Environment's vLLM."""
    path = getattr(env.vllm, "path", None)
    return str(path) if path is not None else None


def of_recorded(site, recorded) -> Fingerprint:
    """The fingerprint of a tree whose judgement the hashes vouch for (patch_dsv4.fastpath.quick: a state's recorded
    judgement, or the anchors' record of a pristine known build)."""
    return Fingerprint(
        site.vllm_version,
        build_identity(site.dist_info, getattr(site, "metadata", None)),
        site.flashinfer_version,
        site.flashinfer_source,
        recorded.opt_in,
        {pid: v["verdict"] for pid, v in recorded.verdicts.items()},
        recorded.files,
    )


def of_judged(env, build: str | None, opt_in, reports, files: dict) -> Fingerprint:
    """The fingerprint of a tree judged in full: ``reports`` (each with ``id`` and ``verdict``) and the sha256 of
    every file the judgement read (``files``); ``build``: :func:`build_identity` of its dist-info, as read."""
    return Fingerprint(
        env.vllm_version,
        build,
        env.flashinfer_version,
        env.flashinfer_source,
        opt_in,
        {r.id: r.verdict.value for r in reports},
        files,
    )


def of_manifest(env, build: str | None, manifest) -> Fingerprint:
    """The fingerprint of the tree a write just left: the judgement its manifest records."""
    return Fingerprint(
        env.vllm_version,
        build,
        env.flashinfer_version,
        env.flashinfer_source,
        manifest.opt_in,
        {pid: v["verdict"] for pid, v in manifest.verdicts.items()},
        manifest.inputs,
    )


# -- verify --expect -------------------------------------------------------------------------
def expect(document: dict, served, expected: str) -> list[str]:
    """Compare the fingerprint of a verify ``document`` (``served``: a Fingerprint, or its text) with ``expected``.

    When they differ, the document fails (exit 1), its notes say what differs, and its summary says so; the
    differences are returned (the caller writes them on stderr). BadFingerprint when ``expected`` is none.
    """
    if isinstance(served, Fingerprint):
        found = served.differences(expected)
    else:
        found = [] if equal(served, expected) else ["the trees differ (this fingerprint was read back, not made here)"]
    if not found:
        document["notes"] = [*document["notes"], "the fingerprint is the expected one"]
        return found
    document["exit_code"] = document["exit_code"] or 1
    document["notes"] = [*document["notes"], *(f"fingerprint differs: {d}" for d in found)]
    document["summary"] += "; the fingerprint differs from --expect"
    document["next"] = document["next"] or (
        "patch-dsv4 status -v here and where the expected fingerprint came from: every node must run one image"
    )
    return found


def write_differences(found: list[str], stream=None) -> None:
    """The differences on stderr, in the one layout of messages (80 columns): also where stdout is a report in
    JSON, or is thrown away (a launcher's ``verify --expect ... >/dev/null``)."""
    if not found:
        return
    from patch_dsv4.output.render import message_lines

    stream = stream or sys.stderr
    lines = message_lines(("", f"fingerprint differs from the expected one: {line}") for line in found)
    stream.write("\n".join(lines) + "\n")
