"""The launcher's commands run as `python -m launcher.NAME` (docs/architecture.md)."""

import sys

if sys.argv[:1] == ["-m"]:  # started as a command: its imports take seconds
    import signal

    def _stopped(signum: int, frame) -> None:
        """A stop signal before the command's own handling of one (a command that has none
        keeps this): one line and the status a shell gives it, not a traceback from the
        middle of an import."""
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for _signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_signal, _stopped)
