"""The `diffgemma` command line (typer): ask, chat, prompt, serve, score, replay, golden, download, quantize,
repack, bench, train, eval, census. Each command's typer signature (its `--help`) lives in a module of this package
by topic; the work each command does lives in its own module elsewhere."""

from __future__ import annotations

import sys

import typer

from diffgemma.cli.benchmark import bench
from diffgemma.cli.census import census
from diffgemma.cli.oplog import golden, replay
from diffgemma.cli.options import _NO_ARGS_IS_HELP, _USAGE_ERROR
from diffgemma.cli.questions import score
from diffgemma.cli.serving import serve
from diffgemma.cli.talk import ask, chat, prompt
from diffgemma.cli.training import eval_, train
from diffgemma.cli.weights import download, quantize, repack

app = typer.Typer(add_completion=False, no_args_is_help=True, help="DiffusionGemma inference engine.")
for command in (
    ask,
    chat,
    prompt,
    serve,
    score,
    replay,
    golden,
    download,
    quantize,
    repack,
    bench,
    train,
    census,
):
    app.command()(command)
app.command("eval")(eval_)


def main() -> None:
    # Not click's standalone mode: it prints a usage error as a boxed block, and every other error here is one line.
    try:
        code = app(standalone_mode=False)
    except _NO_ARGS_IS_HELP as e:  # a bare `diffgemma`: the help (a vendored click has printed it already)
        if e.format_message():
            e.show()
        raise SystemExit(2) from None
    except _USAGE_ERROR as e:
        where = "diffgemma" if e.ctx is None or e.ctx.parent is None else f"diffgemma {e.ctx.info_name}"
        print(f"diffgemma: error: {e.format_message()} (see `{where} --help`)", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C outside a reply (e.g. while loading): quit quietly
        print("diffgemma: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)
