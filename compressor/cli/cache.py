"""``compressor cache``: where the statistics cache is, how big, clear it; ``compressor clean``: the work and
staging folders killed runs left (:func:`compressor.inputs.safety.leftovers`), listed, and removed on request."""

from __future__ import annotations

from compressor.cli.common import add_common


def add_parsers(sub) -> None:
    p = sub.add_parser("cache", help="the statistics cache: where it is, how big, clear it",
                       description="Measured statistics are cached (~0.6 GB per model/data/setting for SmolLM2) in "
                       "$COMPRESSOR_CACHE, else $COMPRESSOR_CACHE_DIR, else $XDG_CACHE_HOME/compressor, else "
                       "~/.cache/compressor; least recently used entries are evicted above $COMPRESSOR_CACHE_MAX_GB "
                       "(default 4).")
    p.add_argument(
        "action", choices=["info", "clear"], help="info: location, entries, size, cap; clear: delete all entries"
    )
    add_common(p)
    p.set_defaults(handler=handle, heavy=False)

    p = sub.add_parser("clean", help="list (and --remove) the work and staging folders killed runs left",
                       description="A run writes beside its output: a size run's work folder .<name>.size-<pid> "
                       "(the F16 and llama.cpp's preset: GBs for a large model; .<name>@<host>.size-<pid> under "
                       "output.workdir), the staging folder .<name>.tmp-<pid>, and an earlier output moved aside "
                       ".<name>.old-<pid>. Every exit removes them, Ctrl-C and SIGTERM included; SIGKILL, a crash "
                       "or a lost machine leaves them until the same output runs again. This lists them in each "
                       "FOLDER (the folders holding your outputs, and any output.workdir) with their sizes; "
                       "--remove deletes those whose process no longer exists on this machine. The folders of a "
                       "run still running are never touched.")
    p.add_argument("folders", nargs="*", default=["."], metavar="FOLDER",
                   help="a folder holding outputs, or an output.workdir (default: the current folder)")
    p.add_argument("--remove", action="store_true", help="remove the stale ones (their process no longer exists)")
    add_common(p)
    p.set_defaults(handler=handle_clean, heavy=False)


def handle_clean(args) -> int:
    import shutil
    import sys
    from pathlib import Path

    from compressor.engine.cache import human_bytes
    from compressor.inputs.safety import folder_bytes, leftovers

    folders = [Path(f).expanduser() for f in args.folders]
    for f in folders:
        if not f.is_dir():
            what = "is a file" if f.exists() else "does not exist"
            print(f"error: {f} {what}; give the folder that holds your outputs (or an output.workdir)",
                  file=sys.stderr)
            return 2
    stale, freed = [], 0
    for folder in folders:
        for left in leftovers(folder):
            size = folder_bytes(left.path)
            print(f"{left.state:9} {human_bytes(size):>9}  {left.path}  {left.describe()}")
            if left.state != "stale":
                continue
            stale.append(left)
            if args.remove:
                shutil.rmtree(left.path, ignore_errors=True)
                freed += size if not left.path.exists() else 0
    where = ", ".join(str(f) for f in folders)
    if not stale:
        print(f"no stale folders in {where}")
    elif args.remove:
        print(f"removed {len(stale)} stale folder{'s' * (len(stale) != 1)} ({human_bytes(freed)})")
    else:
        again = " ".join(args.folders)
        print(f"{len(stale)} stale folder{'s' * (len(stale) != 1)}; remove {'them' if len(stale) > 1 else 'it'} "
              f"with: compressor clean {again} --remove")
    return 0


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
