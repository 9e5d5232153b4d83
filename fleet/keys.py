"""The TUF signing keys (Ed25519 through python-tuf / securesystemslib) and who holds which.

Two layouts:

``edgefleet keys init DIR`` (the zero-set-up default) writes one key per top-level role (``root``,
``targets``, ``snapshot``, ``timestamp``) and the first ``root.json``; the fleet holds them all and
signs every bundle itself. Simple, but whoever owns the fleet server can ship any model.

``edgefleet keys create DIR`` splits the keys by where they live::

    DIR/offline/root.key, targets.key      offline (a safe, an HSM): only to rotate or revoke keys
    DIR/fleet/snapshot.key, timestamp.key  on the fleet server: re-signs freshness every few hours
    DIR/ci/bundles.key                     in the compiler's CI: signs each bundle (delegated role)
    DIR/fleet/root.json                    the anchor of trust every agent is given
    DIR/fleet/targets.json                 top-level targets: delegates every path to ``bundles``
    DIR/fleet/bundles.json                 the first (empty) bundles metadata, signed by CI

The fleet is started with ``--keys DIR/fleet``. A compromised fleet server has only the snapshot
and timestamp keys: it can withhold updates (until the timestamp expires) but cannot make a device
install a bundle the CI key did not sign.

A key need not be a file: ``edgefleet keys rotate DIR ROLE --key-uri URI`` puts the role's new key wherever
securesystemslib can sign from (``hsm:2?label=TOKEN``: a PKCS#11 token, an HSM, a YubiKey, with ``PYKCS11LIB``
naming its module and ``$EDGEFLEET_HSM_PIN`` its PIN; ``encfile:PATH``: a PKCS#8 PEM file encrypted with the
passphrase in ``$EDGEFLEET_KEY_PASSPHRASE``; ``file2:PATH``; the cloud KMS schemes). Only the URI and the public
key are written, as ``ROLE.uri.json`` beside where ``ROLE.key`` would be; files stay the default.

``rotate`` and ``revoke`` write newly signed ``root.json`` (a new version, signed by the old and the
new root keys, kept as ``roots/N.root.json``) or ``targets.json`` into the fleet folder, where the
fleet publishes them (on start, or at once with ``--publish-to``); agents that were offline walk
the root versions in order when they come back.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.manifest import Manifest
from ..protocol.tuf_target import TargetCustom
from ..protocol.tuf_target import target_path as _target_path
from .errors import KeyStoreError

__all__ = [
    "BUNDLES_ROLE",
    "ROLES",
    "KeyStore",
    "bundle_target",
    "create_keys",
    "init_keys",
    "revoke_key",
    "role_signer",
    "rotate_key",
    "sign_bundle",
    "signer_from_uri",
]

ROLES = ("root", "targets", "snapshot", "timestamp")
BUNDLES_ROLE = "bundles"  # the delegated targets role the compiler's CI signs bundles with
ROOT_EXPIRY_DAYS = 365
TARGETS_EXPIRY_DAYS = 365  # signed offline: long-lived; freshness comes from snapshot and timestamp
BUNDLES_EXPIRY_DAYS = 365
WHERE = {"root": "offline", "targets": "offline", "snapshot": "fleet", "timestamp": "fleet", BUNDLES_ROLE: "ci"}


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _new_key(path: Path) -> Any:
    """Generate an Ed25519 key, write it (PKCS#8 PEM, 0600) and return its signer."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from securesystemslib.signer import CryptoSigner

    priv = Ed25519PrivateKey.generate()
    _write_private(path, priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return CryptoSigner(priv)


ENV_PASSPHRASE = "EDGEFLEET_KEY_PASSPHRASE"  # an encfile: key's passphrase
ENV_PIN = "EDGEFLEET_HSM_PIN"  # a PKCS#11 token's user PIN
URI_SUFFIX = ".uri.json"


def _secret(name: str) -> str:
    """securesystemslib's secrets handler: a PIN or passphrase from the environment, never a prompt (the fleet and
    CI run unattended)."""
    var = ENV_PIN if name.lower() == "pin" else ENV_PASSPHRASE
    value = os.environ.get(var)
    if not value:
        raise KeyStoreError(f"the key needs its {name}: set ${var}")
    return value


def _encfile_signer_class() -> type:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    class EncryptedFileSigner(CryptoSigner):
        """``encfile:PATH``: a PKCS#8 PEM private key encrypted with a passphrase (securesystemslib's ``file2:``
        reads unencrypted files only)."""

        SCHEME = "encfile"

        @classmethod
        def from_priv_key_uri(cls, priv_key_uri: str, public_key: Any, secrets_handler: Any = None) -> Any:
            path = Path(priv_key_uri.partition(":")[2])
            passphrase = (secrets_handler or _secret)("passphrase")
            priv = load_pem_private_key(path.read_bytes(), password=passphrase.encode())
            return CryptoSigner(priv, public_key)  # type: ignore[arg-type]

    return EncryptedFileSigner


def _signer_table() -> dict[str, type]:
    from securesystemslib.signer import SIGNER_FOR_URI_SCHEME

    return {**SIGNER_FOR_URI_SCHEME, "encfile": _encfile_signer_class()}


def _public_key_of(uri: str) -> Any:
    """The public key behind a key URI (read from the token or file: nothing is written)."""
    from urllib.parse import parse_qs, urlsplit

    from securesystemslib.signer import SSlibKey

    scheme = uri.partition(":")[0]
    try:
        if scheme == "hsm":
            from securesystemslib.signer import HSMSigner

            u = urlsplit(uri)
            label = parse_qs(u.query).get("label", [None])[0]
            _uri, key = HSMSigner.import_(int(u.path) if u.path else None, label)
            return key
        if scheme in ("encfile", "file2"):
            from cryptography.hazmat.primitives.serialization import load_pem_private_key

            password = _secret("passphrase").encode() if scheme == "encfile" else None
            priv = load_pem_private_key(Path(uri.partition(":")[2]).read_bytes(), password=password)
            return SSlibKey.from_crypto(priv.public_key())  # type: ignore[arg-type]
    except KeyStoreError:
        raise
    except Exception as exc:  # securesystemslib, pkcs11 and cryptography raise their own types
        raise KeyStoreError(f"{uri}: cannot read its public key ({type(exc).__name__}: {exc})") from exc
    raise KeyStoreError(f"{uri}: a new key's public half is read from hsm:, encfile: or file2: URIs; for a KMS "
                        "key, add its public key to root.json with your KMS tooling")


def signer_from_uri(uri: str, public_key: Any, role: str) -> Any:
    """A securesystemslib signer for the key at ``uri`` (PIN or passphrase from the environment)."""
    from securesystemslib.signer import Signer

    scheme = uri.partition(":")[0]
    table = _signer_table()
    if scheme not in table:
        raise KeyStoreError(f"the {role} key URI {uri!r}: unknown scheme {scheme!r} (one of "
                            f"{', '.join(sorted(table))})")
    try:
        import securesystemslib.signer as sslib_signer

        saved = dict(sslib_signer.SIGNER_FOR_URI_SCHEME)
        sslib_signer.SIGNER_FOR_URI_SCHEME.update(table)
        try:
            signer = Signer.from_priv_key_uri(uri, public_key, _secret)
            setattr(signer, "edgefleet_uri", uri)  # noqa: B010  (named in errors: _sign)
            return signer
        finally:
            sslib_signer.SIGNER_FOR_URI_SCHEME.clear()
            sslib_signer.SIGNER_FOR_URI_SCHEME.update(saved)
    except KeyStoreError:
        raise
    except Exception as exc:
        raise KeyStoreError(f"the {role} key at {uri}: {type(exc).__name__}: {exc}") from exc


def _write_uri_key(path: Path, uri: str, key: Any) -> None:
    """``ROLE.uri.json``: where a key lives and its public half (no secret in it)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"uri": uri, "key": {"keyid": key.keyid, **key.to_dict()}}, indent=2) + "\n")


def _uri_signer(path: Path, role: str) -> Any:
    import json

    from securesystemslib.signer import Key

    try:
        doc = json.loads(path.read_text())
        kd = dict(doc["key"])
        key = Key.from_dict(kd.pop("keyid"), kd)
        uri = str(doc["uri"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyStoreError(f"{path}: not a key URI file ({exc})") from exc
    return signer_from_uri(uri, key, role)


def role_signer(folder: Path, role: str, stem: str | None = None) -> Any:
    """The signer of ``role`` in ``folder``: ``STEM.key`` (a file, the default) or ``STEM.uri.json`` (a URI)."""
    stem = stem or role
    uri_file = folder / f"{stem}{URI_SUFFIX}"
    if not (folder / f"{stem}.key").exists() and uri_file.exists():
        return _uri_signer(uri_file, role)
    return load_signer(folder / f"{stem}.key", role)


def _has_key(folder: Path, stem: str) -> bool:
    return (folder / f"{stem}.key").exists() or (folder / f"{stem}{URI_SUFFIX}").exists()


def load_signer(path: Path, role: str) -> Any:
    from cryptography.hazmat.primitives import serialization
    from securesystemslib.signer import CryptoSigner

    try:
        priv = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise KeyStoreError(f"{path}: no {role} key here (the {role} key lives {WHERE.get(role, '?')}); "
                            "point at the folder that holds it") from exc
    except ValueError as exc:
        raise KeyStoreError(f"{path}: not a readable private key ({exc})") from exc
    return CryptoSigner(priv)  # type: ignore[arg-type]


def _sign(md: Any, signer: Any, append: bool = False) -> None:
    """``md.sign``, with a signer that fails (a wrong PIN, a token unplugged, a KMS refusing) as a KeyStoreError
    naming the key rather than python-tuf's bare "Problem signing the metadata"."""
    from tuf.api.exceptions import UnsignedMetadataError

    try:
        md.sign(signer, append=append)
    except UnsignedMetadataError as exc:
        cause = exc.__cause__ or exc
        where = getattr(signer, "edgefleet_uri", None) or "its file"
        raise KeyStoreError(f"the key at {where} could not sign ({type(cause).__name__}: "
                            f"{' '.join(str(cause).split()) or 'no detail'}); a wrong PIN or passphrase?") from exc


def _dump(md: Any) -> bytes:
    from tuf.api.serialization.json import JSONSerializer

    return md.to_bytes(JSONSerializer(compact=False))


def init_keys(directory: Path, force: bool = False) -> Path:
    """Create the four role keys and a signed ``root.json`` in one folder; returns the root.json path."""
    from tuf.api.metadata import Metadata, Root

    directory.mkdir(parents=True, exist_ok=True)
    existing = [r for r in ROLES if (directory / f"{r}.key").exists()]
    if existing and not force:
        raise KeyStoreError(f"{directory} already holds keys ({', '.join(existing)}); "
                            "pass --force to replace them (devices trusting the old root.json will refuse the fleet)")
    for r in ROLES:
        (directory / f"{r}.key").unlink(missing_ok=True)
    root = Root(expires=_now() + dt.timedelta(days=ROOT_EXPIRY_DAYS), consistent_snapshot=True)
    signers = {role: _new_key(directory / f"{role}.key") for role in ROLES}
    for role, signer in signers.items():
        root.add_key(signer.public_key, role)
    md = Metadata(root)
    md.sign(signers["root"])
    out = directory / "root.json"
    out.write_bytes(_dump(md))
    return out


def create_keys(directory: Path, force: bool = False) -> Path:
    """The split layout (module docstring): returns the fleet folder to start the fleet with."""
    from tuf.api.metadata import DelegatedRole, Delegations, Metadata, Root, Targets

    offline, fleet, ci = directory / "offline", directory / "fleet", directory / "ci"
    if any(d.exists() and any(d.iterdir()) for d in (offline, fleet, ci)):
        if not force:
            raise KeyStoreError(f"{directory} already holds keys; pass --force to replace them (devices trusting "
                                "the old root.json will refuse the fleet)")
        for d in (offline, fleet, ci):
            shutil.rmtree(d, ignore_errors=True)
    signers = {"root": _new_key(offline / "root.key"), "targets": _new_key(offline / "targets.key"),
               "snapshot": _new_key(fleet / "snapshot.key"), "timestamp": _new_key(fleet / "timestamp.key"),
               BUNDLES_ROLE: _new_key(ci / f"{BUNDLES_ROLE}.key")}
    root = Root(expires=_now() + dt.timedelta(days=ROOT_EXPIRY_DAYS), consistent_snapshot=True)
    for role in ROLES:
        root.add_key(signers[role].public_key, role)
    root_md = Metadata(root)
    root_md.sign(signers["root"])
    (fleet / "roots").mkdir(parents=True, exist_ok=True)
    (fleet / "roots" / "1.root.json").write_bytes(_dump(root_md))
    (fleet / "root.json").write_bytes(_dump(root_md))

    ci_key = signers[BUNDLES_ROLE].public_key
    # TUF matches a pattern segment by segment ("*" never spans a "/"): name/version/profile.tar and deeper
    paths = ["/".join(["*"] * n) for n in range(1, 6)]
    delegation = DelegatedRole(name=BUNDLES_ROLE, keyids=[ci_key.keyid], threshold=1, terminating=True, paths=paths)
    targets = Metadata(Targets(expires=_now() + dt.timedelta(days=TARGETS_EXPIRY_DAYS),
                               delegations=Delegations(keys={ci_key.keyid: ci_key},
                                                       roles={BUNDLES_ROLE: delegation})))
    targets.sign(signers["targets"])
    (fleet / "targets.json").write_bytes(_dump(targets))
    bundles = Metadata(Targets(expires=_now() + dt.timedelta(days=BUNDLES_EXPIRY_DAYS)))
    bundles.sign(signers[BUNDLES_ROLE])
    (fleet / f"{BUNDLES_ROLE}.json").write_bytes(_dump(bundles))
    (ci / f"{BUNDLES_ROLE}.json").write_bytes(_dump(bundles))  # CI's last signed version
    return fleet


def _latest_root(fleet: Path) -> Any:
    from tuf.api.metadata import Metadata, Root

    return Metadata[Root].from_bytes((fleet / "root.json").read_bytes())


def _save_root(fleet: Path, md: Any) -> Path:
    data = _dump(md)
    (fleet / "roots").mkdir(exist_ok=True)
    out = fleet / "roots" / f"{md.signed.version}.root.json"
    out.write_bytes(data)
    (fleet / "root.json").write_bytes(data)
    return out


def _retire(path: Path, keyid: str) -> None:
    """Keep an old private key beside the new one, renamed, for the operator to destroy (a key URI's record too:
    the key itself stays in its token)."""
    if path.exists():
        path.rename(path.with_name(f"{path.stem}.{keyid[:12]}.retired"))
    uri_file = path.with_name(path.name.removesuffix(".key") + URI_SUFFIX)
    if uri_file.exists():
        uri_file.rename(uri_file.with_name(f"{uri_file.name}.{keyid[:12]}.retired"))


def _next_key(key_path: Path, uri: str | None, old_keyids: list[str]) -> Any:
    """Retire the old keys and return the new one: a new file at ``key_path``, or the key at ``uri`` (recorded in
    ``key_path``'s ``.uri.json``), which is read first, so a wrong URI, PIN or passphrase leaves the old key as is."""
    stem = key_path.name.removesuffix(".key")
    signer = None
    if uri is not None:
        key = _public_key_of(uri)
        signer = signer_from_uri(uri, key, stem)
    for keyid in old_keyids:
        _retire(key_path, keyid)
    if uri is None:
        return _new_key(key_path)
    _write_uri_key(key_path.with_name(stem + URI_SUFFIX), uri, key)
    return signer


def rotate_key(directory: Path, role: str, uri: str | None = None) -> Path:
    """Replace ``role``'s key by a new one (a new file, or the key at ``uri``: an HSM, an encrypted file...);
    returns the newly signed metadata (root.json, or targets.json for the CI's ``bundles`` key). Needs the offline
    folder (root; targets for bundles)."""
    from tuf.api.metadata import Metadata, Targets

    offline, fleet = directory / "offline", directory / "fleet"
    if role == BUNDLES_ROLE:
        targets_signer = role_signer(offline, "targets")
        md = Metadata[Targets].from_bytes((fleet / "targets.json").read_bytes())
        assert md.signed.delegations is not None and md.signed.delegations.roles is not None
        old = list(md.signed.delegations.roles[BUNDLES_ROLE].keyids)
        key_path = directory / "ci" / f"{BUNDLES_ROLE}.key"
        new = _next_key(key_path, uri, old)
        md.signed.add_key(new.public_key, BUNDLES_ROLE)
        for keyid in old:
            md.signed.revoke_key(keyid, BUNDLES_ROLE)
        return _resign_targets(fleet, md, targets_signer)
    if role not in ROLES:
        raise KeyStoreError(f"unknown role {role!r}: one of {', '.join((*ROLES, BUNDLES_ROLE))}")
    root_md = _latest_root(fleet)
    old_root_signer = role_signer(offline, "root")
    old = list(root_md.signed.roles[role].keyids)
    key_path = (offline if WHERE[role] == "offline" else fleet) / f"{role}.key"
    new = _next_key(key_path, uri, old)
    root_md.signed.add_key(new.public_key, role)
    for keyid in old:
        root_md.signed.revoke_key(keyid, role)
    root_md.signed.version += 1
    root_md.signed.expires = _now() + dt.timedelta(days=ROOT_EXPIRY_DAYS)
    root_md.signatures.clear()
    _sign(root_md, old_root_signer, append=True)  # the old root vouches for the new one ...
    if role == "root":
        _sign(root_md, new, append=True)  # ... and the new root key signs it too, as TUF requires
    return _save_root(fleet, root_md)


def revoke_key(directory: Path, role: str, keyid: str) -> Path:
    """Remove one key from ``role`` without adding another (a stolen CI key, a second root key...).
    A role left with fewer keys than its threshold is refused: rotate instead."""
    from tuf.api.metadata import Metadata, Targets

    offline, fleet = directory / "offline", directory / "fleet"
    if role == BUNDLES_ROLE:
        md = Metadata[Targets].from_bytes((fleet / "targets.json").read_bytes())
        assert md.signed.delegations is not None and md.signed.delegations.roles is not None
        deleg = md.signed.delegations.roles[BUNDLES_ROLE]
        if keyid not in deleg.keyids:
            raise KeyStoreError(f"key {keyid[:12]}… is not a {role} key (they are: "
                                f"{', '.join(k[:12] + '…' for k in deleg.keyids)})")
        if len(deleg.keyids) - 1 < deleg.threshold:
            raise KeyStoreError(f"revoking {keyid[:12]}… would leave {role} without enough keys; "
                                f"use 'edgefleet keys rotate {role}' to replace it")
        md.signed.revoke_key(keyid, BUNDLES_ROLE)
        return _resign_targets(fleet, md, role_signer(offline, "targets"))
    if role not in ROLES:
        raise KeyStoreError(f"unknown role {role!r}: one of {', '.join((*ROLES, BUNDLES_ROLE))}")
    root_md = _latest_root(fleet)
    r = root_md.signed.roles[role]
    if keyid not in r.keyids:
        raise KeyStoreError(f"key {keyid[:12]}… is not a {role} key")
    if len(r.keyids) - 1 < r.threshold:
        raise KeyStoreError(f"revoking {keyid[:12]}… would leave {role} without enough keys; "
                            f"use 'edgefleet keys rotate {role}' to replace it")
    root_md.signed.revoke_key(keyid, role)
    root_md.signed.version += 1
    root_md.signatures.clear()
    _sign(root_md, role_signer(offline, "root"))
    return _save_root(fleet, root_md)


def add_key(directory: Path, role: str) -> tuple[Path, str]:
    """Give ``role`` one more key (e.g. a second CI runner); returns (signed metadata, new keyid)."""
    from tuf.api.metadata import Metadata, Targets

    if role != BUNDLES_ROLE:
        raise KeyStoreError("only the CI's bundles role takes extra keys here; rotate the others")
    md = Metadata[Targets].from_bytes((directory / "fleet" / "targets.json").read_bytes())
    n = len(list((directory / "ci").glob(f"{BUNDLES_ROLE}*.key")))
    new = _new_key(directory / "ci" / f"{BUNDLES_ROLE}-{n + 1}.key")
    md.signed.add_key(new.public_key, BUNDLES_ROLE)
    return _resign_targets(directory / "fleet", md, role_signer(directory / "offline", "targets")), \
        new.public_key.keyid


def _resign_targets(fleet: Path, md: Any, signer: Any) -> Path:
    md.signed.version += 1
    md.signed.expires = _now() + dt.timedelta(days=TARGETS_EXPIRY_DAYS)
    md.signatures.clear()
    _sign(md, signer)
    out = fleet / "targets.json"
    out.write_bytes(_dump(md))
    return out


def bundle_target(manifest: Manifest) -> tuple[str, TargetCustom]:
    """The TUF target path of a bundle and the custom fields signed with it (the fleet's signature or the
    CI key's): agents refuse a bundle their CPU cannot run before downloading it."""
    return _target_path(manifest), TargetCustom.of(manifest)


def sign_bundle(key: Path, current: bytes, target_path: str, bundle: Path, custom: dict[str, Any]) -> bytes:
    """What the compiler's CI runs: the next version of the ``bundles`` metadata (``current``, as the
    fleet publishes it) with ``bundle`` added as ``target_path``, signed with the CI key."""
    from tuf.api.metadata import Metadata, TargetFile, Targets

    from ..protocol.bundle import check_bundle

    signer = _uri_signer(key, BUNDLES_ROLE) if key.name.endswith(URI_SUFFIX) else load_signer(key, BUNDLES_ROLE)
    check_bundle(bundle)  # never sign an archive the agent would refuse (BundleError names the problem)
    md = Metadata[Targets].from_bytes(current)
    if target_path in md.signed.targets:
        raise KeyStoreError(f"{target_path} is already signed; publish a new version instead of replacing one")
    tf = TargetFile.from_file(target_path, str(bundle), ["sha256"])
    tf.unrecognized_fields["custom"] = custom
    md.signed.targets[target_path] = tf
    md.signed.version += 1
    md.signed.expires = _now() + dt.timedelta(days=BUNDLES_EXPIRY_DAYS)
    md.signatures.clear()
    _sign(md, signer)
    return bytes(_dump(md))


@dataclass
class KeyStore:
    """The keys the fleet server holds (one folder)."""

    directory: Path

    def signer(self, role: str) -> Any:
        path = self.directory / f"{role}.key"
        if not _has_key(self.directory, role):
            raise KeyStoreError(f"{path}: no {role} key; run 'edgefleet keys init {self.directory}' "
                                f"(or, with 'keys create', the {role} key lives {WHERE.get(role, '?')})")
        return role_signer(self.directory, role)

    def has(self, role: str) -> bool:
        return _has_key(self.directory, role)

    @property
    def root_json(self) -> Path:
        p = self.directory / "root.json"
        if not p.exists():
            raise KeyStoreError(f"{p}: missing; run 'edgefleet keys init {self.directory}'")
        return p

    def roots(self) -> list[bytes]:
        """Every root version this folder holds, oldest first (``roots/N.root.json``, else root.json)."""
        found = sorted(self.directory.glob("roots/*.root.json"), key=lambda p: int(p.name.split(".")[0]))
        return [p.read_bytes() for p in found] or [self.root_json.read_bytes()]

    @property
    def offline_targets(self) -> Path | None:
        """Top-level targets metadata signed offline (the split layout), if this folder has it."""
        p = self.directory / "targets.json"
        return p if p.exists() else None

    @property
    def initial_bundles(self) -> Path | None:
        p = self.directory / f"{BUNDLES_ROLE}.json"
        return p if p.exists() else None
