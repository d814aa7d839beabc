"""`dflash-fast <command>`: one subcommand per pipeline stage.

Each stage module defines `add_arguments(parser)` and `run(args)`; the module is
imported only when its command runs, so `dflash-fast --help` stays fast. A user
error ends the command in one `error: ...` line (exit 2 for usage, 1 for data);
`--debug` (before or after the command) or DFLASH_DEBUG=1 shows its traceback
(dflash_fast/errors.py).
"""
import argparse
import importlib
import sys

from dflash_fast.errors import DEBUG_ENV, run_reporting_errors

COMMANDS = {
    "convert-gguf": ("dflash_fast.target.gguf", "turn a GGUF target (llama.cpp's file) into a plain Hugging Face "
                     "checkpoint every stage and vLLM load"),
    "extract": ("dflash_fast.extract.extract", "run the target over JSONL data and write a hidden-state store"),
    "serve-target": ("dflash_fast.extract.serve", "serve the target's hidden states to trainers over TCP "
                     "(data.online.address)"),
    "verify": ("dflash_fast.store.reader", "check every shard of a store against the sha256 sums recorded at "
               "extraction"),
    "export": ("dflash_fast.train.export_checkpoint", "write a trained drafter in the speculators/vLLM format"),
    "eval": ("dflash_fast.evaluate.evaluate", "real block speculative decoding: measure acceptance length tau"),
    "regenerate": ("dflash_fast.extract.regenerate", "let the target write the responses to a prompt set"),
    "quickstart": ("dflash_fast.evaluate.quickstart", "the whole pipeline on the embedded target, on CPU"),
    "real-target": ("dflash_fast.evaluate.real_target", "the whole pipeline on a real LLM (SmolLM2-135M-Instruct, "
                    "GGUF from PyPI) and ShareGPT, on CPU: docs/real-target.md"),
    "plot": ("dflash_fast.evaluate.plot", "draw loss, tau_offline and per-slot accuracy curves of a run"),
}
DEBUG_HELP = f"show the traceback of an error (also: {DEBUG_ENV}=1)"


def command_parser(name: str):
    """(the stage module, the argparse parser of `dflash-fast NAME`): what `main` runs and `--help` shows."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"dflash-fast {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return module, parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = argv[:1] == ["--debug"]
    argv = argv[1:] if debug else argv
    parser = argparse.ArgumentParser(prog="dflash-fast", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    module, cmd_parser = command_parser(argv[0])
    args = cmd_parser.parse_args(argv[1:])
    return run_reporting_errors(lambda: module.run(args), debug or args.debug)


if __name__ == "__main__":
    sys.exit(main())
