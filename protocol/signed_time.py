"""The fleet's signed time: what a device whose clock is wrong trusts instead (as Uptane's time server).

A device asks ``GET /api/v1/time?nonce=N`` with a random nonce of its own; the fleet answers::

    {"signed": {"_type": "edgefleet-time", "nonce": N, "time": "2026-11-29T04:30:00Z"},
     "signatures": [{"keyid": ..., "sig": ...}]}

signed with the TUF timestamp role's key (the online key the fleet already re-signs freshness with), over the
canonical JSON of ``signed`` (securesystemslib's encoding, as TUF's own metadata). The device checks it with the
timestamp role's keys and threshold from the root it trusts (``Root.get_verification_result``), and that the nonce
is the one it just sent: a recorded answer cannot be replayed to set a device's clock back. No new cryptography:
the key, the signature scheme and the verification are TUF's.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from securesystemslib.formats import encode_canonical
from securesystemslib.signer import Signature

from . import jsonlimits
from .errors import SchemaError

__all__ = ["MAX_DOCUMENT_BYTES", "NONCE_RE", "TYPE", "describe_skew", "sign_time", "verify_time"]

TYPE = "edgefleet-time"
NONCE_RE = re.compile(r"^[0-9a-f]{32,64}$")
MAX_DOCUMENT_BYTES = 16 * 1024  # a statement with a few signatures is under 1 KiB
MAX_SIGNATURES = 16
_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def _payload(signed: dict[str, Any]) -> bytes:
    return encode_canonical(signed).encode()  # type: ignore[no-any-return,union-attr]


def sign_time(signer: Any, now: dt.datetime, nonce: str) -> dict[str, Any]:
    """The statement "it is ``now``" for ``nonce``, signed by ``signer`` (the timestamp role's securesystemslib
    Signer). ValueError for a malformed nonce."""
    if not NONCE_RE.match(nonce):
        raise ValueError("the nonce must be 32-64 lowercase hex digits")
    signed = {"_type": TYPE, "nonce": nonce, "time": now.astimezone(dt.timezone.utc).strftime(_FORMAT)}
    sig = signer.sign(_payload(signed))
    return {"signed": signed, "signatures": [sig.to_dict()]}


def verify_time(raw: bytes, root: Any, nonce: str, source: str = "the fleet's signed time") -> dt.datetime:
    """The time ``raw`` states, once its signatures meet the threshold of the timestamp role of ``root`` (a
    tuf.api.metadata.Root) and it answers ``nonce``. SchemaError (a ContractError) for anything else."""
    doc = jsonlimits.loads(raw, source=source, max_bytes=MAX_DOCUMENT_BYTES)
    if not isinstance(doc, dict) or set(doc) != {"signed", "signatures"}:
        raise SchemaError(source, ["expected an object with exactly 'signed' and 'signatures'"])
    signed, sigs = doc["signed"], doc["signatures"]
    if not isinstance(signed, dict) or set(signed) != {"_type", "nonce", "time"} or signed["_type"] != TYPE:
        raise SchemaError(source, [f"'signed' must hold exactly _type ({TYPE!r}), nonce and time"])
    if signed["nonce"] != nonce:
        raise SchemaError(source, ["it answers another nonce than the one sent (a replayed answer?)"])
    if not isinstance(sigs, list) or not 1 <= len(sigs) <= MAX_SIGNATURES:
        raise SchemaError(source, [f"'signatures' must be a list of 1-{MAX_SIGNATURES} signatures"])
    try:
        when = dt.datetime.strptime(str(signed["time"]), _FORMAT).replace(tzinfo=dt.timezone.utc)
        parsed = [Signature.from_dict(dict(s)) for s in sigs]
    except (ValueError, TypeError, KeyError) as exc:
        raise SchemaError(source, [f"unreadable: {exc}"]) from exc
    try:
        result = root.get_verification_result("timestamp", _payload(signed), {s.keyid: s for s in parsed})
    except (ValueError, TypeError, KeyError) as exc:  # a key of an unknown scheme, a malformed signature
        raise SchemaError(source, [f"cannot be verified: {exc}"]) from exc
    if not result.verified:
        raise SchemaError(source, [f"not signed by {result.threshold} of the timestamp role's keys the trusted "
                                   f"root names ({len(result.signed)} valid signatures)"])
    return when


def describe_skew(skew_s: float) -> str:
    """A clock's skew in words, as the agent logs it and the console shows it: '2.0 days ahead of',
    '400.0 days behind', '12 min ahead of'."""
    way = "ahead of" if skew_s > 0 else "behind"
    s = abs(skew_s)
    return f"{s / 86400:.1f} days {way}" if s >= 86400 else f"{s / 3600:.1f} h {way}" if s >= 3600 \
        else f"{s / 60:.0f} min {way}"
