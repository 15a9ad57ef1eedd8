"""The parser of the argparse-based commands (bench, train, eval): a usage error is one line on stderr and exit
status 2, in the form of every other `diffgemma` error, not argparse's usage block."""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"diffgemma: error: {message} (see `{self.prog} --help`)\n")
