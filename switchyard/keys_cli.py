"""`switchyard keys new | check`: make an API key's line, and check a keys file before the router reads it.

Why: the router keeps its previous keys when an edited file does not load (a warning in its log), so a typo in a
new line shows only as a refused client; `check` says what is wrong, and what each key may do, before the file is
put in place.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from switchyard.auth import AuthError, KeySpec, parse_line, read_keys

KEY_BYTES = 24  # 48 hex characters: 192 bits


def describe(spec: KeySpec) -> str:
    limits = [f"max_in_flight={spec.max_in_flight}"] if spec.max_in_flight else []
    if spec.rate:
        limits.append(f"rate={spec.rate:g}/s burst={spec.burst}")
    if spec.tokens_per_min:
        limits.append(f"tokens_per_min={spec.tokens_per_min}")
    if spec.isolate:
        limits.append("isolated cache")
    return f"{spec.name}: {', '.join(limits) or 'no limits'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="switchyard keys", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="print a keys-file line with a fresh random key")
    new.add_argument("--name", default="")
    new.add_argument("--max-in-flight", type=int, default=0)
    new.add_argument("--rate", type=float, default=0.0, help="calls per second (0 = no limit)")
    new.add_argument("--burst", type=int, default=0, help="calls at once past the rate (default ceil(rate))")
    new.add_argument("--tokens-per-min", type=int, default=0,
                     help="model tokens (prompt + max_tokens, the unused output given back) a minute (0 = no limit)")
    new.add_argument("--isolate", action="store_true", help="a prefix cache of its own")
    check = sub.add_parser("check", help="check a keys file as the router reads it; exit 2 naming what is wrong")
    check.add_argument("file")
    args = p.parse_args(argv)
    if args.command == "new":
        fields = [f"name={args.name}"] if args.name else []
        fields += [f"max_in_flight={args.max_in_flight}"] if args.max_in_flight else []
        fields += [f"rate={args.rate:g}"] if args.rate else []
        fields += [f"burst={args.burst}"] if args.burst else []
        fields += [f"tokens_per_min={args.tokens_per_min}"] if args.tokens_per_min else []
        fields += ["isolate=true"] if args.isolate else []
        line = " ".join([secrets.token_hex(KEY_BYTES), *fields])
        try:  # the line as the router will read it
            parse_line(line.split(), "the new key")
        except AuthError as e:
            print(f"switchyard keys new: {e}", file=sys.stderr)
            return 2
        print(line)
        return 0
    try:
        keys = read_keys(args.file)
    except AuthError as e:
        print(f"switchyard keys check: {e}", file=sys.stderr)
        return 2
    print(f"{args.file}: {len(keys)} key{'s' if len(keys) != 1 else ''}")
    for spec in keys.values():
        print(f"  {describe(spec)}")
    return 0
