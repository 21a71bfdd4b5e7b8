"""One exception type for bad input, and the CLI wrapper that turns it into one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys


class JaxspecError(Exception):
    """A user-facing error: bad model file, bad arguments, unsupported architecture, too-long prompt."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a JaxspecError, so they print as one line like any bad input."""

    def error(self, message):
        raise JaxspecError(message)


@contextlib.contextmanager
def out_of_memory_as(message):
    """Turns XLA's RESOURCE_EXHAUSTED inside the block into JaxspecError(message()): a device that runs out of
    memory is sized input (a batch, a length) that this machine cannot hold, told in one line."""
    import jax  # here, not at the top: importing this module (a CLI's flag checks) stays free of jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise JaxspecError(f"out of device memory: {message()}") from None


def cli_main(main):
    """Runs `main`, printing `error: <message>` on stderr and exiting 2 for any `JaxspecError`."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except JaxspecError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
