"""`secagg-roc keys`: make the study CA and every party's key pair and certificate.

Run by the study coordinator once, after writing the study file and before
starting any party. Wire it into the main CLI with `add_keys_parser` and
`run_keys`; ``python -m secagg_roc.deploy.cli_keys`` runs it on its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..errors import ConfigError
from .config_read import load_study
from .pki import create_study_keys

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

Private keys are unencrypted PEM files with mode 0600: file permissions are
their only protection. Existing files are never replaced unless --force is given.
"""

_EPILOG = """\
examples:
  secagg-roc keys --study study.toml
  secagg-roc keys --study study.toml --out staging/   # same layout under staging/
  secagg-roc keys --study study.toml --force          # re-key: ALL old certificates stop working
"""


def add_keys_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``keys`` subcommand to an `argparse` subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "keys", help="create the study CA and every party's key and certificate",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run_keys)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", required=True, metavar="STUDY.toml",
                        help="the study file naming the study and its parties")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write under DIR instead of the study file's folder, keeping the "
                             "same relative layout (every path must lie inside the study folder)")
    parser.add_argument("--force", action="store_true",
                        help="replace existing CA and party keys (a new CA: every party needs "
                             "its new files)")


def run_keys(args: argparse.Namespace) -> int:
    """Run ``secagg-roc keys``; 0 on success, 2 on a configuration error (message on stderr)."""
    try:
        config = load_study(args.study)
        issued = create_study_keys(config, args.out, force=args.force)
    except ConfigError as exc:
        print(f"secagg-roc keys: error: {exc}", file=sys.stderr)
        return 2
    print(f"study {config.study_id!r}: created a CA and {len(issued.parties)} party key pairs")
    print(f"  PUBLIC  {issued.ca_cert}  (study CA certificate, for every party)")
    print(f"  SECRET  {issued.ca_key}  (study CA key, keep offline)")
    for p in issued.parties:
        print(f"  {p.role:<10} {p.name}: PUBLIC {p.cert}  SECRET {p.key}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="secagg-roc keys", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_keys(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
