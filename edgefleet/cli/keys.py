"""``edgefleet keys init|create|rotate|revoke``: the TUF signing keys, split by where they live."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Formatter, command, show
from edgefleet.protocol.exits import ExitCode


@command("keys", advise="compiler", imports=("edgefleet.fleet.keys",))
def cmd_keys_init(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import init_keys

    root = init_keys(a.dir, force=a.force)
    show({"ok": True, "keys_dir": str(a.dir), "root": str(root)}, a.json,
           f"wrote TUF keys (root, targets, snapshot, timestamp) to {a.dir}\n"
           f"give agents {root} as --trusted-root; keep root.key offline in production")
    return ExitCode.OK


def _keys_answer(a: argparse.Namespace, doc: dict[str, Any], human: str) -> int:
    show({"ok": True, **doc}, a.json, human)
    return ExitCode.OK


def _publish_signed(a: argparse.Namespace, path: Path) -> str:
    if a.publish_to is None:
        return f"the fleet publishes {path.name} when it starts next (or pass --publish-to)"
    from edgefleet.fleet.keys import KeyStore
    from edgefleet.fleet.tuf_repo import Repository

    repo = Repository(a.publish_to, KeyStore(a.dir / "fleet"))
    (repo.publish_targets if path.name == "targets.json" else repo.publish_root)(path.read_bytes())
    return f"published in {a.publish_to}"


@command("keys", advise="compiler")
def cmd_keys_create(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import create_keys

    fleet = create_keys(a.dir, force=a.force)
    return _keys_answer(a, {"fleet_keys": str(fleet), "offline": str(a.dir / "offline"), "ci": str(a.dir / "ci")},
                        f"offline (root, targets; keep off any server): {a.dir / 'offline'}\n"
                        f"fleet (snapshot, timestamp; start the fleet with --keys): {fleet}\n"
                        f"ci (bundles: signs each bundle, delegated): {a.dir / 'ci'}\n"
                        f"give agents {fleet / 'root.json'} as --trusted-root")


@command("keys", advise="compiler")
def cmd_keys_rotate(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import rotate_key

    out = rotate_key(a.dir, a.role, a.key_uri)
    return _keys_answer(a, {"role": a.role, "signed": str(out)},
                        f"new {a.role} key; signed {out}; {_publish_signed(a, out)}")


@command("keys", advise="compiler")
def cmd_keys_revoke(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import revoke_key

    out = revoke_key(a.dir, a.role, a.keyid)
    return _keys_answer(a, {"role": a.role, "keyid": a.keyid, "signed": str(out)},
                        f"revoked {a.role} key {a.keyid[:12]}…; signed {out}; {_publish_signed(a, out)}")


def add_parsers(sub: Any) -> None:
    k = sub.add_parser("keys", help="manage the TUF signing keys").add_subparsers(dest="keys_cmd", required=True)
    ki = k.add_parser("init", formatter_class=Formatter, help="create root/targets/snapshot/timestamp keys",
                      description="Create one Ed25519 key per TUF role and the first signed root.json.")
    ki.add_argument("dir", type=Path, help="folder for the keys (created; files are mode 0600)")
    ki.add_argument("--force", action="store_true", help="replace existing keys (devices must get the new root.json)")
    ki.add_argument("--json", action="store_true", help="JSON output")
    ki.set_defaults(fn=cmd_keys_init)
    kc = k.add_parser("create", formatter_class=Formatter, help="create keys split by where they live",
                      description="Root and targets keys for offline storage, snapshot and timestamp keys for the "
                                  "fleet, and a 'bundles' key for the compiler's CI (a delegated targets role): a "
                                  "compromised fleet server alone cannot make a device install a model.")
    kc.add_argument("dir", type=Path, help="folder for offline/, fleet/ and ci/ (files are mode 0600)")
    kc.add_argument("--force", action="store_true", help="replace existing keys (devices must get the new root.json)")
    kc.add_argument("--json", action="store_true", help="JSON output")
    kc.set_defaults(fn=cmd_keys_create)
    for name, fn, help_ in (("rotate", cmd_keys_rotate, "replace a role's key (needs the offline keys)"),
                            ("revoke", cmd_keys_revoke, "remove one key from a role (needs the offline keys)")):
        kr = k.add_parser(name, formatter_class=Formatter, help=help_, description=help_ + "; writes a newly "
                          "signed root.json (or targets.json for 'bundles') into DIR/fleet.")
        kr.add_argument("dir", type=Path, help="the folder from 'edgefleet keys create'")
        kr.add_argument("role", choices=("root", "targets", "snapshot", "timestamp", "bundles"))
        if name == "revoke":
            kr.add_argument("keyid", help="the key's id (hex), as in root.json or targets.json")
        else:
            kr.add_argument("--key-uri", help="the new key is not a file here but at this URI: hsm:2?label=TOKEN "
                            "(PKCS#11; PYKCS11LIB, $EDGEFLEET_HSM_PIN), encfile:PATH (an encrypted PKCS#8 PEM; "
                            "$EDGEFLEET_KEY_PASSPHRASE), file2:PATH")
        kr.add_argument("--publish-to", type=Path, help="a fleet's TUF folder (DATA_DIR/tuf) to publish in at once")
        kr.add_argument("--json", action="store_true", help="JSON output")
        kr.set_defaults(fn=fn)
