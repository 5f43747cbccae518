"""`brigade schema`: the JSON Schema of the submit and of every event, for clients in any language."""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "schema", help="print the JSON Schema of the submit (llm.in) and of every event"
    )
    p.add_argument(
        "name",
        nargs="?",
        help="one schema only: 'submit' or an event type (accepted, tokens, text, ...)",
    )
    p.add_argument("--indent", type=int, default=2, help="JSON indent (0: one line)")
    p.set_defaults(func=run)


def schemas() -> dict[str, object]:
    """{'submit': schema, '<event type>': schema, ...} from the msgspec Structs themselves."""
    import msgspec

    from schemas.events import EVENT_TYPES, Submit

    out: dict[str, object] = {"submit": msgspec.json.schema(Submit)}
    for tag, cls in EVENT_TYPES.items():
        out[tag] = msgspec.json.schema(cls)
    return out


def run(args) -> int:
    table = schemas()
    if args.name is not None:
        if args.name not in table:
            print(
                f"brigade schema: unknown name {args.name!r}; choose one of: {', '.join(table)}",
                file=sys.stderr,
            )
            return 2
        table = table[args.name]
    print(json.dumps(table, indent=args.indent or None))
    return 0
