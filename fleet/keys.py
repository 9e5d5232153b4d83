"""The signing keys of the fleet's TUF repository (Ed25519 through python-tuf / securesystemslib).

``edgefleet keys init DIR`` writes one private key per TUF role (``root``, ``targets``,
``snapshot``, ``timestamp``; PKCS#8 PEM, mode 0600) and ``root.json``, the first signed root
metadata. Agents are given ``root.json`` as their anchor of trust; the fleet signs with the other
keys. Keep ``root.key`` offline in production: the fleet needs it only to rotate keys.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import KeyStoreError

__all__ = ["ROLES", "KeyStore", "init_keys"]

ROLES = ("root", "targets", "snapshot", "timestamp")
ROOT_EXPIRY_DAYS = 365


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def init_keys(directory: Path, force: bool = False) -> Path:
    """Create the four role keys and a signed ``root.json``; returns the root.json path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata, Root
    from tuf.api.serialization.json import JSONSerializer

    directory.mkdir(parents=True, exist_ok=True)
    existing = [r for r in ROLES if (directory / f"{r}.key").exists()]
    if existing and not force:
        raise KeyStoreError(f"{directory} already holds keys ({', '.join(existing)}); "
                            "pass --force to replace them (devices trusting the old root.json will refuse the fleet)")
    for r in ROLES:
        (directory / f"{r}.key").unlink(missing_ok=True)
    root = Root(expires=dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(days=ROOT_EXPIRY_DAYS),
                consistent_snapshot=True)
    signers = {}
    for role in ROLES:
        priv = Ed25519PrivateKey.generate()
        pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        _write_private(directory / f"{role}.key", pem)
        signers[role] = CryptoSigner(priv)
        root.add_key(signers[role].public_key, role)
    md = Metadata(root)
    md.sign(signers["root"])
    out = directory / "root.json"
    out.write_bytes(md.to_bytes(JSONSerializer(compact=False)))
    return out


@dataclass
class KeyStore:
    directory: Path

    def signer(self, role: str):
        from cryptography.hazmat.primitives import serialization
        from securesystemslib.signer import CryptoSigner

        path = self.directory / f"{role}.key"
        try:
            priv = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError as exc:
            raise KeyStoreError(f"{path}: no {role} key; run 'edgefleet keys init {self.directory}'") from exc
        except ValueError as exc:
            raise KeyStoreError(f"{path}: not a readable private key ({exc})") from exc
        return CryptoSigner(priv)  # type: ignore[arg-type]

    @property
    def root_json(self) -> Path:
        p = self.directory / "root.json"
        if not p.exists():
            raise KeyStoreError(f"{p}: missing; run 'edgefleet keys init {self.directory}'")
        return p
