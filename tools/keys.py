"""`brigade keys add TENANT`: issue a new API key (printed once; only its hash is stored)."""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("keys", help="manage tenants' API keys")
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION")
    add = sub.add_parser("add", help="issue a new key for TENANT and print it once")
    add.add_argument("tenant", help="tenant name ([A-Za-z0-9_-], up to 64 characters)")
    add.add_argument(
        "--file",
        type=Path,
        help="tenants file (default: $BRIGADE_TENANTS or .brigade/tenants.toml)",
    )
    add.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])


def run(args) -> int:
    import re

    from stages.tenancy import tenants

    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", args.tenant):
        print(
            f"brigade keys add: tenant {args.tenant[:80]!r} must be 1-64 of A-Z a-z 0-9 _ -",
            file=sys.stderr,
        )
        return 2
    path = args.file or tenants.default_path()
    try:
        key = tenants.add_key(args.tenant, path=path)
    except ValueError as err:
        print(f"brigade keys add: {err}", file=sys.stderr)
        return 2
    print(key)
    print(
        f"added a key for tenant {args.tenant!r} to {path}; it is shown only now "
        "(only its hash is stored)",
        file=sys.stderr,
    )
    return 0
