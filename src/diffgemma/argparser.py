"""The argparse parser of the argparse-based commands (bench, train, eval): a usage error is one line on stderr
and exit status 2, as the typer commands' errors are, not argparse's usage block."""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
