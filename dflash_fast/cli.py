"""`dflash-fast <command>`: one subcommand per pipeline stage.

Each stage module defines `add_arguments(parser)` and `run(args)`; the module is
imported only when its command runs, so `dflash-fast --help` stays fast.
"""
import argparse
import importlib
import sys

COMMANDS = {
    "extract": ("dflash_fast.extract", "run the target over JSONL data and write a hidden-state store"),
    "export": ("dflash_fast.export", "write a trained drafter in the speculators/vLLM format"),
    "eval": ("dflash_fast.evaluate", "real block speculative decoding: measure acceptance length tau"),
    "regenerate": ("dflash_fast.regenerate", "let the target write the responses to a prompt set"),
    "quickstart": ("dflash_fast.quickstart", "the whole pipeline on the embedded target, on CPU"),
    "plot": ("dflash_fast.plot", "draw loss, tau_offline and per-slot accuracy curves of a run"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dflash-fast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"dflash-fast {name}", description=COMMANDS[name][1])
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return module.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
