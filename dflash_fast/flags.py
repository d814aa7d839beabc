"""A command's parsed flags handed to the function that does its work, by parameter name.

It sits below every stage (beside errors.py) so that a stage module may use it while dflash_fast/cli.py, above
every stage, imports the stage modules by name.
"""
import argparse
import inspect


def call_with_flags(fn, args: argparse.Namespace, **overrides):
    """fn called with each parsed flag named as one of its parameters (`--max-new-tokens` -> max_new_tokens),
    then `overrides` (flags whose meaning is not the parameter's, such as `--no-baseline`)."""
    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in vars(args).items() if k in names}, **overrides)
