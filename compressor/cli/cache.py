"""``compressor cache``: where the statistics cache is, how big, clear it."""

from __future__ import annotations

from compressor.cli.common import add_common


def add_parsers(sub) -> None:
    p = sub.add_parser("cache", help="the statistics cache: where it is, how big, clear it",
                       description="Measured statistics are cached (~0.6 GB per model/data/setting for SmolLM2) in "
                       "$COMPRESSOR_CACHE, else $COMPRESSOR_CACHE_DIR, else $XDG_CACHE_HOME/compressor, else "
                       "~/.cache/compressor; least recently used entries are evicted above $COMPRESSOR_CACHE_MAX_GB "
                       "(default 4).")
    p.add_argument("action", choices=["info", "clear"], help="info: location, entries, size, cap; clear: delete all entries")
    add_common(p)
    p.set_defaults(handler=handle, heavy=False)


def handle(args) -> int:
    from compressor.engine import cache

    if args.action == "clear":
        where = cache.cache_dir()
        n = cache.clear()
        print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {where}")
        return 0
    i = cache.info()
    print(f"location: {i['location']}")
    print(f"entries:  {i['entries']}")
    print(f"size:     {cache.human_bytes(i['total_bytes'])}")
    print(f"cap:      {cache.human_bytes(i['max_bytes'])} (COMPRESSOR_CACHE_MAX_GB)")
    return 0


