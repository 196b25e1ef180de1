"""Placeholder: `polymq bench nsq` is being written."""

import click


@click.command()
def command() -> None:
    """Benchmark an nsqd-compatible server (not written yet)."""
    raise click.ClickException("not written yet")
