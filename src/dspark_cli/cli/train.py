"""`dspark train` (being written)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this command to the app (filled in by the train issue)."""
