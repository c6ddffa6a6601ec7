"""`secagg-roc keys`: make the study CA and every party's key pair; add or revoke one party's.

Run by the study coordinator: ``keys`` once, after writing the study file and
before starting any party; ``keys add NAME`` for a party added to the study
file later (or, with ``--replace``, new keys for one party); ``keys revoke
NAME`` to put a party's certificate on the study's revocation list, which
every other party then refuses. Wire it into the main CLI with
`add_keys_parser` and `run_keys`; ``python -m secagg_roc.deploy.cli_keys``
runs it on its own. Needs only a base install.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..errors import ConfigError
from .config_read import load_study
from .pki import add_party_keys, create_study_keys, revoke_party

__all__ = ["add_keys_parser", "run_keys", "main"]

_DESCRIPTION = """\
Create the study CA and, for every aggregator, site and the analyst named in
the study file, an ECDSA P-256 private key and a certificate signed by the CA.
Each certificate binds the party's study, role and name
(SAN URI secagg-roc://<study>/<role>/<name>).

Files are written where the study file says (by default relative to its folder):
  ca.pem                  PUBLIC  the study CA certificate: give it to every party
  keys/<party>/cert.pem   PUBLIC  give it to <party>
  keys/<party>/key.pem    SECRET  give it to <party> only, over a secure channel
  keys/_ca/key.pem        SECRET  the CA key: keep it offline; it can mint parties

  crl.pem                 PUBLIC  the study's revocation list: give it to every party

Private keys are unencrypted PEM files with mode 0600: file permissions are
their only protection. Existing files are never replaced unless --force is given.

  keys add NAME       make a key and certificate for one party with the existing CA: a
                      hospital added to the study file later; no other party's files change
                      (--replace: new keys for a party that has some, e.g. after a revocation)
  keys revoke NAME    put NAME's current certificate on crl.pem; hand the new crl.pem to every
                      party: each re-reads it within seconds and refuses that certificate from
                      then on (aggregators a site's or the analyst's; the others an aggregator's)
"""

_EPILOG = """\
examples:
  secagg-roc keys --study study.toml
  secagg-roc keys --study study.toml --out staging/   # same layout under staging/
  secagg-roc keys add hospital-e --study study.toml   # a hospital added to study.toml later
  secagg-roc keys revoke hospital-b --study study.toml
  secagg-roc keys add hospital-b --study study.toml --replace   # its new key and certificate
  secagg-roc keys --study study.toml --force          # re-key: ALL old certificates stop working
"""


def add_keys_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``keys`` subcommand to an `argparse` subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "keys", help="create the study CA and every party's key and certificate; add or revoke one party's",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run_keys)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("create", "add", "revoke"), default="create",
                        help="'create' the CA and every party's keys (default), 'add' one party's, "
                             "'revoke' one party's certificate")
    parser.add_argument("party", nargs="?", metavar="NAME", help="the party to add or revoke")
    parser.add_argument("--replace", action="store_true",
                        help="with add: replace the party's existing key and certificate (only that party's)")
    parser.add_argument("--study", required=True, metavar="STUDY.toml",
                        help="the study file naming the study and its parties")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write under DIR instead of the study file's folder, keeping the "
                             "same relative layout (every path must lie inside the study folder)")
    parser.add_argument("--force", action="store_true",
                        help="replace existing CA and party keys (a new CA: every party needs "
                             "its new files)")


def _add_or_revoke(args: argparse.Namespace) -> int:
    config = load_study(args.study)
    if args.party is None:
        raise ConfigError(f"keys {args.action} needs the party's name: secagg-roc keys {args.action} NAME --study ...")
    if args.out is not None or args.force:
        raise ConfigError(f"keys {args.action} works in the study folder: --out and --force are for creating all keys")
    if args.action == "add":
        p = add_party_keys(config, args.party, replace=args.replace)
        print(f"study {config.study_id!r}: issued {p.role} {p.name!r} a new key and certificate")
        print(f"  PUBLIC  {p.cert}\n  SECRET  {p.key}  (hand it to {p.name} only)")
        print(f"  {p.name} also needs the study's {config.ca_cert.name}"
              + (" and the updated study file; restart the aggregators with it" if p.role == "site" else ""))
        return 0
    serial, crl, new = revoke_party(config, args.party)
    state = "revoked" if new else "was already revoked"
    print(f"study {config.study_id!r}: the certificate of {args.party!r} (serial {serial:x}) {state}")
    print(f"  PUBLIC  {crl}: hand it to every party (they re-read it within seconds)")
    print(f"  new keys for {args.party}: secagg-roc keys add {args.party} --replace --study {args.study}")
    return 0


def run_keys(args: argparse.Namespace) -> int:
    """Run ``secagg-roc keys`` (and ``keys add``/``keys revoke``); 0 on success, 2 on a configuration error."""
    try:
        if args.action != "create":
            return _add_or_revoke(args)
        if args.replace or args.party is not None:
            raise ConfigError("a party name and --replace go with `keys add NAME` (or `keys revoke NAME`)")
        config = load_study(args.study)
        issued = create_study_keys(config, args.out, force=args.force)
    except ConfigError as exc:
        print(f"secagg-roc keys: error: {exc}", file=sys.stderr)
        return 2
    print(f"study {config.study_id!r}: created a CA and {len(issued.parties)} party key pairs")
    print(f"  PUBLIC  {issued.ca_cert}  (study CA certificate, for every party)")
    print(f"  SECRET  {issued.ca_key}  (study CA key, keep offline)")
    if issued.ca_crl is not None:
        print(f"  PUBLIC  {issued.ca_crl}  (revocation list, for every party)")
    for p in issued.parties:
        print(f"  {p.role:<10} {p.name}: PUBLIC {p.cert}  SECRET {p.key}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`secagg-roc keys`: make and sign the study's TLS keys and certificates (exit code)."""
    parser = argparse.ArgumentParser(
        prog="secagg-roc keys", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_keys(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
