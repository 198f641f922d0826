"""The ``fenced`` command."""

from __future__ import annotations

import sys

try:
    import typer
except ImportError:  # pragma: no cover - exercised only without the extra
    typer = None  # type: ignore[assignment]

app = typer.Typer(no_args_is_help=True, add_completion=False) if typer else None


def main() -> None:
    """Entry point of the ``fenced`` command."""
    if app is None:
        sys.exit("the fenced command needs its extra: pip install 'fenced[cli]'")
    app()


if app is not None:

    @app.command()
    def demo() -> None:
        """Run the walkthrough on an embedded Redis."""
        from .demo.walkthrough import run

        raise typer.Exit(run())

    @app.command()
    def version() -> None:
        """Print the version."""
        from . import __version__

        print(__version__)
