"""`ddpo-group serve REWARD [--port P ...]`: the reward server (ddpo_group/rewards/server.py) over HTTP;
`ddpo-group serve --serve REWARD ...` and `python -m ddpo_group.rewards.server --serve REWARD ...` are the same."""

from __future__ import annotations

import sys
from typing import Sequence

PROG = "ddpo-group serve"


def serve_main(argv: Sequence[str] | None = None, prog: str = PROG) -> None:
    """The reward server's command with the reward as the first argument (`--serve REWARD` as well); `argv`: the
    arguments after the command (default sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--serve", *argv]
    named = any(arg == "--serve" or arg.startswith("--serve=") for arg in argv)
    if not named and not {"-h", "--help"} & set(argv):
        print(f"{prog}: error: name the reward to serve first, e.g. {prog} aesthetic --port 8000 "
              f"({prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)  # argparse's status for a command-line error
    from ddpo_group.rewards.server import main  # uvicorn is imported only when it serves

    if named or not {"-h", "--help"} & set(argv):
        main(argv, prog=prog, help_command=f"{prog} --help")
        return
    # --help of the documented form: the reward is the first argument, not a required --serve
    import contextlib
    import io

    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            main(argv, prog=prog, help_command=f"{prog} --help")
    finally:
        print(text.getvalue().replace(f"{prog} [-h] --serve REWARD_NAME", f"{prog} REWARD [-h]", 1).replace(
            "--serve REWARD_NAME   registered", "REWARD, --serve REWARD_NAME\n                        registered", 1),
            end="")
